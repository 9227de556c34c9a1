// A C++ device guard for the `jax` (PrivateUse1) device.
//
// torch's Python-level guard calls back into Python from noexcept code, so an exception
// raised by an op during `loss.backward()` would abort the process. This no-op guard keeps
// errors in backward ordinary Python exceptions. Built once with torch's cpp_extension.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
struct JaxGuard final : public c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::PrivateUse1> {
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, JaxGuard);
}  // namespace

int jaxtorch_guard_loaded() { return 1; }
