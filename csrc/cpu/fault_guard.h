// Reading a memory-mapped file that another process truncates: touching a
// mapped page past the file's new end raises SIGBUS, whose default action
// kills the process. `run_guarded` runs a read of such memory so that a
// SIGBUS it raises returns false instead, on whichever thread it runs.
//
// A process-wide SIGBUS handler, installed on first use, jumps back
// (siglongjmp) to the guard point of the thread that faulted when that
// thread is inside run_guarded and the faulting address lies in the bytes
// it guards. Any other SIGBUS is handed to the handler installed before
// (Python's faulthandler, pytest's), or takes the default action, exactly
// as without zeroscan. A handler installed after zeroscan's sees every
// SIGBUS first, guarded ones included: faulthandler.enable() called after
// the first guarded scan turns a guarded fault back into a fatal one.
//
// Jumping out of the read skips whatever it was doing, so the read must be
// plain arithmetic over raw pointers: no allocation, no lock, no object with
// a destructor between the guard point and the reads (a skipped destructor
// is undefined behaviour), and no static initialiser that could be
// interrupted.
#pragma once

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#if defined(__x86_64__)
#include <xmmintrin.h>
#else
#include <cfenv>
#endif

namespace zeroscan {
namespace cpu {

// One thread's guard point, on its stack while run_guarded runs.
struct FaultGuard {
  sigjmp_buf env;
  uintptr_t lo, hi;  // the guarded bytes [lo, hi)
  sigset_t mask;     // the thread's signal mask when the fault came
#if defined(__x86_64__)
  unsigned mxcsr;  // signal delivery resets it (DAZ/FTZ, rounding)
#else
  fenv_t fenv;
#endif
};

// The calling thread's guard, or null. The handler reads it, so it is
// initial-exec TLS: the default model for a dlopen'ed library may allocate
// a thread's TLS block on its first access, and malloc is not
// async-signal-safe. It is one pointer, so it costs little of the static
// TLS space kept for such libraries.
__attribute__((tls_model("initial-exec"))) inline thread_local FaultGuard* current_fault_guard =
    nullptr;

// Guards active in the process: while none is, the handler passes every
// SIGBUS on without looking at TLS.
inline std::atomic<int64_t> active_fault_guards{0};

// The SIGBUS disposition that zeroscan's handler replaced.
inline struct sigaction previous_sigbus;

// Hands a SIGBUS that is not a guarded read's to the disposition that was
// there before zeroscan's handler, as if that had received it.
inline void pass_sigbus_on(int sig, siginfo_t* info, void* context) {
  const struct sigaction& prev = previous_sigbus;
  const bool from_fault = info != nullptr && info->si_code > 0;  // not kill() or raise()
  if (prev.sa_handler == SIG_IGN && !from_fault) return;
  if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
    // Put the old disposition back: a fault then repeats when the handler
    // returns and the kernel kills the process with SIGBUS (it does so even
    // for an ignored one), as it would have; a sent signal is sent again.
    sigaction(sig, &prev, nullptr);
    if (!from_fault) raise(sig);  // blocked until this handler returns
    return;
  }
  if (prev.sa_flags & SA_RESETHAND) {
    struct sigaction reset = {};
    reset.sa_handler = SIG_DFL;
    sigaction(sig, &reset, nullptr);
  }
  // The previous handler expects its own mask blocked while it runs; this
  // handler's return restores the interrupted mask.
  pthread_sigmask(SIG_BLOCK, &prev.sa_mask, nullptr);
  if (prev.sa_flags & SA_SIGINFO) {
    prev.sa_sigaction(sig, info, context);
  } else {
    prev.sa_handler(sig);
  }
}

inline void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (active_fault_guards.load(std::memory_order_acquire) > 0) {
    FaultGuard* guard = current_fault_guard;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    if (guard != nullptr && info->si_code > 0 && addr >= guard->lo && addr < guard->hi) {
      // The jump leaves the handler without its return restoring the
      // thread's mask, which would keep SIGBUS blocked (and a later fault
      // would kill the process): the guard restores the mask saved here.
      guard->mask = static_cast<ucontext_t*>(context)->uc_sigmask;
      siglongjmp(guard->env, 1);
    }
  }
  pass_sigbus_on(sig, info, context);
}

// Installs on_sigbus once per process. SA_ONSTACK: on a thread with an
// alternate signal stack (faulthandler gives the main thread one), the
// handler and the one it passes to run there, so a fault that comes from a
// stack overflow is still reported.
inline void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action = {};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// Runs read() with a SIGBUS on the bytes [lo, hi) turned into `false`
// (true: read() finished). read() must obey the rules of the file comment.
// After a fault the thread's signal mask and floating-point control state
// are as they were before the call.
template <typename Read>
bool run_guarded(const void* lo, const void* hi, Read&& read) {
  install_sigbus_handler();
  // In memory, not registers: it is read again after the jump, and the
  // handler writes into it.
  FaultGuard guard;
  guard.lo = reinterpret_cast<uintptr_t>(lo);
  guard.hi = reinterpret_cast<uintptr_t>(hi);
#if defined(__x86_64__)
  guard.mxcsr = _mm_getcsr();
#else
  fegetenv(&guard.fenv);
#endif
  // savemask 0: saving the mask here would cost a system call per guard;
  // the rare jump restores the mask that the handler saved instead.
  if (sigsetjmp(guard.env, 0) != 0) {
    current_fault_guard = nullptr;
    active_fault_guards.fetch_sub(1, std::memory_order_release);
    pthread_sigmask(SIG_SETMASK, &guard.mask, nullptr);
#if defined(__x86_64__)
    _mm_setcsr(guard.mxcsr);
#else
    fesetenv(&guard.fenv);
#endif
    return false;
  }
  // Counted before the pointer is set, so a handler that sees the pointer
  // also sees the count; the fences keep the compiler from moving the reads
  // out of the guarded stretch.
  active_fault_guards.fetch_add(1, std::memory_order_acq_rel);
  current_fault_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  try {
    read();
  } catch (...) {
    current_fault_guard = nullptr;
    active_fault_guards.fetch_sub(1, std::memory_order_release);
    throw;
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  current_fault_guard = nullptr;
  active_fault_guards.fetch_sub(1, std::memory_order_release);
  return true;
}

}  // namespace cpu
}  // namespace zeroscan
