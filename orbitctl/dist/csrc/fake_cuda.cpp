// CUDA's device bookkeeping for a CPU-only build of PyTorch, for the CUDA rehearsal (orbitctl/dist/rehearsal.py):
// a device guard and accelerator hooks that answer "CUDA, 8 devices, device 0" and touch no device. With them,
// fake tensors on `cuda` (FakeTensorMode: shapes, dtypes and devices, no data) index, view and run autograd as
// on a CUDA build; without them a CPU-only build refuses ("PyTorch is not linked with support for cuda
// devices"). Loaded before torch itself, so the hooks are the ones ATen finds when it first asks.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

#include <array>
#include <atomic>

namespace orbitctl_rehearsal {

constexpr auto kCuda = c10::DeviceType::CUDA;

struct FakeCUDAHooks : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  bool hasCUDA() const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
};

// a device guard with device and current-stream bookkeeping (per thread, like CUDA's) and streams and events that
// can be made, recorded, waited on and synchronized at once: no work is ever queued on a fake device
struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceIndex kDevices = c10::impl::kFakeGuardImplMaxDevices;

  c10::DeviceType type() const override { return kCuda; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kCuda, current_device()); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() >= 0 && d.index() < kDevices, "fake CUDA: no device ", d.index());
    current_device() = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device() = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_streams()[index(d)]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::UNSAFE, d, 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, ++next_stream_);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto& slot = current_streams()[index(s.device())];
    auto old = slot;
    slot = s.id();
    return c10::Stream(c10::Stream::UNSAFE, s.device(), old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }

 private:
  static size_t index(c10::Device d) { return d.has_index() ? static_cast<size_t>(d.index()) : 0; }
  static c10::DeviceIndex& current_device() {
    thread_local c10::DeviceIndex device = 0;
    return device;
  }
  static std::array<c10::StreamId, kDevices>& current_streams() {
    thread_local std::array<c10::StreamId, kDevices> streams{};
    return streams;
  }
  mutable std::atomic<c10::StreamId> next_stream_{0};
};

// the device guard: a CUDA build registers its own, so a slot already taken is left alone
struct GuardRegistration {
  GuardRegistration() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(kCuda)];
    if (slot.load() == nullptr) {
      static FakeCudaGuard guard;
      slot.store(&guard);
    }
  }
};
GuardRegistration guard_registration;

}  // namespace orbitctl_rehearsal

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", ::orbitctl_rehearsal::FakeCUDAHooks)
}  // namespace at

// bit 0: the CUDA device guard is registered; bit 1: ATen's CUDA hooks answer that CUDA is there
extern "C" int orbitctl_fake_cuda_state() {
  auto cuda = static_cast<size_t>(orbitctl_rehearsal::kCuda);
  int state = c10::impl::device_guard_impl_registry[cuda].load() != nullptr;
  return state | (at::detail::getCUDAHooks().hasCUDA() ? 2 : 0);
}
