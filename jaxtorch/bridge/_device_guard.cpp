// A C++ device guard for the `jax` (PrivateUse1) device.
//
// torch's Python-level guard calls back into Python from noexcept code, so an exception
// raised by an op during `loss.backward()` would abort the process. This guard behaves like
// that one (one device, index 0; streams and events are no-ops: JAX orders its own work)
// without calling into Python. Built once with torch's cpp_extension.
#include <c10/core/impl/DeviceGuardImplInterface.h>

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
C10_REGISTER_GUARD_IMPL(PrivateUse1, JaxGuard);
}  // namespace

int jaxtorch_guard_loaded() { return 1; }
