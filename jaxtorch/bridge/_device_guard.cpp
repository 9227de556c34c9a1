// A C++ device guard for the `jax` (PrivateUse1) device.
//
// torch's Python-level guard calls back into Python from noexcept code, so an exception
// raised by an op during `loss.backward()` would abort the process. This guard behaves like
// that one (one device, index 0; streams and events are no-ops: JAX orders its own work)
// without calling into Python.
//
// Compiled by the first `import jaxtorch` (`jaxtorch/bridge/tensor/_device.py`, with torch's
// cpp_extension) into a per-user cache keyed by torch's version and this file's hash; the wheel
// itself is pure Python.
// JAXTORCH_TORCH_VERSION is torch.__version__ unquoted (stringified here, so no shell quoting).
// Only c10 and Python's C API are included (not <torch/extension.h>), so it compiles in seconds.
#include <Python.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _device_guard
#endif
#ifndef JAXTORCH_TORCH_VERSION
#define JAXTORCH_TORCH_VERSION unknown
#endif
#define JAXTORCH_CAT_(a, b) a##b
#define JAXTORCH_CAT(a, b) JAXTORCH_CAT_(a, b)
#define JAXTORCH_STR_(a) #a
#define JAXTORCH_STR(a) JAXTORCH_STR_(a)

namespace {
constexpr auto kJax = c10::DeviceType::PrivateUse1;

struct JaxGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kJax; }
  c10::Device exchangeDevice(c10::Device) const override { return getDevice(); }
  c10::Device getDevice() const override { return c10::Device(kJax, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kJax, 0));
  }
  c10::Stream getNewStream(c10::Device, int = 0) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kJax, 0));
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kJax, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

// Registers the guard for PrivateUse1 (called by device.py once it has checked TORCH_VERSION).
PyObject* register_guard(PyObject*, PyObject*) {
  static c10::impl::DeviceGuardImplRegistrar registrar(kJax, new JaxGuard());
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register_guard", register_guard, METH_NOARGS, "Register the C++ device guard for PrivateUse1."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, JAXTORCH_STR(TORCH_EXTENSION_NAME),
                          "jaxtorch's C++ device guard for the jax (PrivateUse1) device.", -1, methods};
}  // namespace

PyMODINIT_FUNC JAXTORCH_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&module_def);
  if (m != nullptr && PyModule_AddStringConstant(m, "TORCH_VERSION", JAXTORCH_STR(JAXTORCH_TORCH_VERSION)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
