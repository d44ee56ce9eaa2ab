// The emulator's scheduler (simt.hpp): fibers, one per thread of the running block, a block barrier, one barrier per warp and one per warpgroup (128 threads). A fiber runs until it reaches a barrier
// or ends. Warps run one at a time up to each block barrier, in an order that flips every
// phase, so that a missing __syncthreads shows as a wrong result.
#include "simt.hpp"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DTRAIN_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(DTRAIN_EMU_ASAN)
#define DTRAIN_EMU_ASAN 1
#endif
#ifdef DTRAIN_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace dtrain_emu {

uint3 thread_idx{}, block_idx{};
dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};

namespace {

constexpr std::size_t kStack = 256 * 1024;
constexpr std::size_t kSlot = 64;  // bytes a lane publishes in one exchange

// ---- fiber contexts --------------------------------------------------------------------------
// A switch happens at every barrier, shuffle and MMA of every emulated thread, so it must be
// cheap. On x86-64 it saves the callee-saved registers and the floating-point control words
// on the old stack and takes the new one (no system call; swapcontext also saves and
// restores the signal mask, one rt_sigprocmask each way, which cost a third of the emulated
// tests' time); elsewhere it is ucontext. Under AddressSanitizer each switch is announced
// to it (the stack it checks accesses against, and its fake stacks).
#if defined(__x86_64__)
}  // namespace
}  // namespace dtrain_emu
// dtrain_emu_switch(from, to): *from = this stack, then resume the stack `to` (System V:
// rbx, rbp, r12-r15, MXCSR and the x87 control word are the callee's to keep).
extern "C" void dtrain_emu_switch(void** from, void* to);
asm(R"(
  .pushsection .text
  .globl dtrain_emu_switch
  .hidden dtrain_emu_switch
  .type dtrain_emu_switch, @function
dtrain_emu_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size dtrain_emu_switch, .-dtrain_emu_switch
  .popsection
)");
namespace dtrain_emu {
namespace {
// What the emulated device gives a block of shared memory: Hopper's 227 KB unless a test
// sets another (dtrain_emu_set_block_smem_limit).
std::size_t block_smem_limit = 227 * 1024;
// dtrain_emu_set_block_order's seed (0: launch order), and the launches run under it.
std::uint64_t block_order_seed = 0, block_order_launches = 0;
struct Context {
  void* sp = nullptr;
  const void* bottom = nullptr;  // the stack, for AddressSanitizer
  std::size_t size = 0;
};
void jump(Context& from, Context& to) { dtrain_emu_switch(&from.sp, to.sp); }
// The stack a first switch to `c` starts `start` on: the frame dtrain_emu_switch pops (the
// control words as they are now, zeroed registers, `start` as the return address), then a
// null return address for `start`, which must never return; `start` is entered with the
// stack as a call leaves it (16-byte aligned before the call).
void make_context(Context& c, char* stack, std::size_t size, void (*start)()) {
  auto top = (reinterpret_cast<std::uintptr_t>(stack) + size) & ~std::uintptr_t{15};
  auto* frame = reinterpret_cast<std::uint64_t*>(top - 72);
  std::uint32_t mxcsr = 0;
  std::uint16_t fpucw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  frame[0] = mxcsr | std::uint64_t{fpucw} << 32;
  for (int i = 1; i <= 6; ++i) frame[i] = 0;  // r15 r14 r13 r12 rbx rbp
  frame[7] = reinterpret_cast<std::uint64_t>(start);
  frame[8] = 0;
  c.sp = frame;
  c.bottom = stack;
  c.size = size;
}
#else
struct Context {
  ucontext_t uc;
  const void* bottom = nullptr;  // the stack, for AddressSanitizer
  std::size_t size = 0;
};
void jump(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
void make_context(Context& c, char* stack, std::size_t size, void (*start)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;  // start never returns
  makecontext(&c.uc, start, 0);
  c.bottom = stack;
  c.size = size;
}
#endif

// Every switch is between the scheduler and a fiber, so the context switched to is the one
// that later switches back: its stack is the one AddressSanitizer says was left. A fiber
// that has ended switches away for good (its fake stack can go).
void switch_context(Context& from, Context& to, bool from_ended = false) {
#ifdef DTRAIN_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(from_ended ? nullptr : &fake, to.bottom, to.size);
  jump(from, to);
  __sanitizer_finish_switch_fiber(fake, &to.bottom, &to.size);
#else
  (void)from_ended;
  jump(from, to);
#endif
}

enum class Wait { kNone, kBlock, kWarp, kGroup, kMbarrier, kNamed, kPass };

struct Fiber {
  Context ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
  Wait wait = Wait::kNone;
  std::uint64_t gen = 0;
  std::uint32_t mbarrier = 0;  // kMbarrier: the barrier's offset, and the parity awaited
  int parity = 0, named = 0;   // kNamed: the barrier id
};

struct Barrier {
  std::uint64_t gen = 0;
  int arrived = 0, alive = 0;
  bool arrive() {  // true when this arrival completes the barrier
    if (++arrived < alive) return false;
    arrived = 0;
    ++gen;
    return true;
  }
  bool leave() {  // true when this departure completes the barrier
    --alive;
    if (arrived > 0 && arrived >= alive) {
      arrived = 0;
      ++gen;
      return true;
    }
    return false;
  }
};

// The race check's happens-before order (see State::seen): a vector clock per warp,
// holding for every warp of the block the last slice of it that this warp is ordered after.
// A barrier, named barrier or mbarrier orders its arrivals before the waits it releases:
// each arrival joins the arriving warp's clock into `arrived`, each completed phase joins
// that into `released`, and a released wait joins `released` into its warp's clock. The
// warp and warpgroup barriers the emulator adds (shuffles, MMA, wgmma issue and wait) order
// nothing: the hardware's wgmma is not a barrier. Clocks per warp, not per thread, and
// `released` only ever growing, can hide a race but never report a false one.
using Clock = std::array<std::uint32_t, 32>;
void join(Clock& into, const Clock& from) {
  for (std::size_t i = 0; i < into.size(); ++i) into[i] = std::max(into[i], from[i]);
}
struct Ordering {
  Clock arrived{}, released{};
};

// A wgmma a thread has issued and not yet retired (its group's wait does the product).
struct WgmmaOp {
  float* d;
  int n;
  std::uint64_t desc_a, desc_b;
  std::uint32_t a[4];
  const std::uint32_t* a_src;  // the A fragment's registers, which must hold a until the wait
  bool a_regs, trans_b, accumulate, bf16;
  std::vector<float> before;  // d at the issue
  int group;                  // 0 until committed
};
struct WgmmaThread {
  std::vector<WgmmaOp> ops;
  int commits = 0;
  bool fenced = false;
};

// A bulk tensor copy issued and not yet landed.
struct TmaCopy {
  TensorMap map;
  int coords[5];
  std::uint32_t dst;
};
struct Mbarrier {
  Ordering order;
  int count = 0, pending = 0;  // arrivals per phase, and still to come in this one
  std::int64_t tx = 0;         // transaction bytes still to come in this phase
  std::uint64_t phase = 0;     // completed phases
  std::vector<TmaCopy> copies;
};
// A bulk reduction a thread has issued and not yet retired (its group's wait adds it).
struct BulkOp {
  float* dst;
  std::uint32_t src, bytes;  // shared-memory offset
  int group;                 // 0 until committed
};
struct BulkThread {
  std::vector<BulkOp> ops;
  int commits = 0;
};
struct NamedBarrier {
  Ordering order;
  int threads = 0, arrived = 0;
  std::uint64_t gen = 0;
};

struct State {
  std::vector<Fiber> fibers;
  std::vector<Barrier> warps, groups;
  std::vector<WgmmaThread> wgmma;
  std::vector<BulkThread> bulk;
  Barrier block;
  Context scheduler;
  int current = 0;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> smem;
  // Shared memory as the async proxy (wgmma operands, bulk reductions' sources) sees it:
  // bulk copies write it; plain stores reach it only through a fence_proxy_async, taken
  // lazily: the next async read after a fence first brings it up to date with smem.
  std::vector<unsigned char> async_smem;
  bool async_fenced = false;
  std::vector<unsigned char> slots;  // [threads][kSlot]
  std::map<std::uint32_t, Mbarrier> mbarriers;  // by shared-memory offset
  NamedBarrier named[16];
  std::uint64_t pass = 0;  // the scheduler's passes over the warpgroups
  std::string error;
  // Race check: a read of shared memory through ldmatrix, a wgmma descriptor or a bulk
  // reduction must be ordered after every store another warp made to those bytes (by a
  // barrier, see Clock). Stores are plain C++ here, so they are found by comparing smem with
  // `seen` (a copy as of the last comparison) at the end of each slice (a warp's turn to run:
  // all its stores then are its own) and for the bytes a check reads. A store of the value
  // a byte already held goes unseen. The async proxy's stores (TMA) are writer 0.
  std::vector<unsigned char> seen;
  std::vector<std::uint8_t> writer;       // warp + 1 that stored the byte last
  std::vector<std::uint32_t> written_in;  // that warp's slice then
  std::vector<Clock> clocks;              // per warp
  Ordering block_order;                   // __syncthreads
  std::uint32_t slices = 0;
  int slice_warp = -1;                    // the warp running now; -1: the scheduler
};
State s;

// ---- the race check (State::seen) --------------------------------------------------------
void release(Ordering& o) { join(o.arrived, s.clocks[s.current / 32]); }
void complete(Ordering& o) {
  join(o.released, o.arrived);
  o.arrived = Clock{};
}
void acquire(const Ordering& o) { join(s.clocks[s.current / 32], o.released); }

// Marks the bytes in [lo, hi) that changed since the last look as the running warp's.
void attribute(std::size_t lo, std::size_t hi) {
  const int w = s.slice_warp;
  if (w < 0) return;
  hi = std::min(hi, s.smem.size());
  constexpr std::size_t kRun = 256;
  for (std::size_t c = lo; c < hi; c += kRun) {
    const std::size_t end = std::min(c + kRun, hi);
    if (std::memcmp(&s.smem[c], &s.seen[c], end - c) == 0) continue;
    for (std::size_t b = c; b < end; ++b) {
      if (s.smem[b] == s.seen[b]) continue;
      s.seen[b] = s.smem[b];
      s.writer[b] = static_cast<std::uint8_t>(w + 1);
      s.written_in[b] = s.clocks[w][w];
    }
  }
}
void begin_slice(int w) {
  s.slice_warp = w;
  s.clocks[w][w] = ++s.slices;
}
void end_slice() {
  attribute(0, s.smem.size());
  s.slice_warp = -1;
}

// Throws unless every byte of [off, off + n) that another warp stored is ordered before
// this read.
void check_ordered(std::size_t off, std::size_t n, const char* what) {
  attribute(off, off + n);
  const int w = s.current / 32;
  for (std::size_t b = off; b < off + n && b < s.smem.size(); ++b) {
    const int j = s.writer[b] - 1;
    if (j >= 0 && j != w && s.written_in[b] > s.clocks[w][j]) {
      throw std::runtime_error("emulator: race: " + std::string(what) + " of warp " + std::to_string(w) +
                               " reads shared memory (byte " + std::to_string(b) + ") that warp " + std::to_string(j) +
                               " stored with no barrier between");
    }
  }
}

void yield() { switch_context(s.fibers[s.current].ctx, s.scheduler); }

// Closes a thread's open group of asynchronous operations (wgmma or bulk): the ops issued
// since the last commit get its number.
template <typename Thread>
void commit_group(Thread& th) {
  ++th.commits;
  for (auto& op : th.ops) {
    if (op.group == 0) op.group = th.commits;
  }
}

void land_copies(Mbarrier& m);  // below

void entry() {
#ifdef DTRAIN_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.scheduler.bottom, &s.scheduler.size);
#endif
  const int me = s.current;
  try {
    (*s.body)();
    if (!s.bulk[me].ops.empty()) {
      throw std::runtime_error("emulator: a thread ended with bulk reductions it did not wait for");
    }
  } catch (const std::exception& e) {
    if (s.error.empty()) s.error = e.what();
  }
  s.fibers[me].done = true;
  release(s.block_order);  // an exited thread counts as arrived at every later __syncthreads
  if (s.block.leave()) complete(s.block_order);
  s.warps[me / 32].leave();
  s.groups[me / 128].leave();
  switch_context(s.fibers[me].ctx, s.scheduler, true);  // for good: never resumed
  std::abort();
}

void set_thread(int linear) {
  thread_idx.x = linear % block_dim.x;
  thread_idx.y = (linear / block_dim.x) % block_dim.y;
  thread_idx.z = linear / (block_dim.x * block_dim.y);
}

void run_block(int threads) {
  for (int i = 0; i < threads; ++i) {
    auto& f = s.fibers[i];
    f.done = false;
    f.wait = Wait::kNone;
#ifdef DTRAIN_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack.get(), kStack);  // its last run's frames, never unwound
#endif
    make_context(f.ctx, f.stack.get(), kStack, entry);
  }
  s.block = Barrier{};
  s.block.alive = threads;
  s.warps.assign((threads + 31) / 32, Barrier{});
  for (int w = 0; w * 32 < threads; ++w) s.warps[w].alive = std::min(32, threads - w * 32);
  s.groups.assign((threads + 127) / 128, Barrier{});
  for (int g = 0; g * 128 < threads; ++g) s.groups[g].alive = std::min(128, threads - g * 128);
  s.wgmma.assign(threads, WgmmaThread{});
  s.bulk.assign(threads, BulkThread{});
  s.mbarriers.clear();
  for (auto& n : s.named) n = NamedBarrier{};
  s.seen = s.smem;
  s.writer.assign(s.smem.size(), 0);
  s.written_in.assign(s.smem.size(), 0);
  s.clocks.assign((threads + 31) / 32, Clock{});
  s.block_order = Ordering{};
  s.slices = 0;
  // One warp at a time runs until all its threads wait at the block barrier (or end), so
  // that a warp gets ahead of the others as far as the barriers allow; the warps of one
  // warpgroup (4 warps) take turns until the whole group waits there, so that a group gets
  // ahead of the others too (its warpgroup barriers need all 4). The order of the groups,
  // the warps and the lanes flips at every pass.
  const int warps = (threads + 31) / 32, groups = (warps + 3) / 4;
  int remaining = threads;
  bool forward = true;
  auto runnable = [&](int i) {
    const auto& f = s.fibers[i];
    if (f.done) return false;
    if (f.wait == Wait::kBlock) return f.gen != s.block.gen;
    if (f.wait == Wait::kWarp) return f.gen != s.warps[i / 32].gen;
    if (f.wait == Wait::kGroup) return f.gen != s.groups[i / 128].gen;
    if (f.wait == Wait::kNamed) return f.gen != s.named[f.named].gen;
    if (f.wait == Wait::kPass) return f.gen != s.pass;
    if (f.wait == Wait::kMbarrier) {
      auto& m = s.mbarriers.at(f.mbarrier);
      land_copies(m);
      return static_cast<int>(m.phase & 1) != f.parity;
    }
    return true;
  };
  auto run_warp = [&](int w) {  // true when any of its threads ran
    const int lanes = std::min(32, threads - w * 32);
    bool ran = false;
    begin_slice(w);
    for (bool any = true; any;) {
      any = false;
      for (int lk = 0; lk < lanes; ++lk) {
        const int i = w * 32 + (forward ? lk : lanes - 1 - lk);
        if (!runnable(i)) continue;
        auto& f = s.fibers[i];
        f.wait = Wait::kNone;
        s.current = i;
        set_thread(i);
        switch_context(s.scheduler, f.ctx);
        // A thread that threw ends the block at once: the others may be waiting on what it
        // never wrote (an ldmatrix lane's row address, say).
        if (!s.error.empty()) throw std::runtime_error("emulator: a kernel thread threw: " + s.error);
        any = ran = true;
        if (f.done) --remaining;
      }
    }
    end_slice();
    return ran;
  };
  while (remaining > 0) {
    bool progressed = false;
    for (int gk = 0; gk < groups; ++gk) {
      const int gi = forward ? gk : groups - 1 - gk;
      const int first = gi * 4, count = std::min(4, warps - first);
      for (bool any = true; any;) {
        any = false;
        for (int wk = 0; wk < count; ++wk) any = run_warp(first + (forward ? wk : count - 1 - wk)) || any;
        progressed = progressed || any;
      }
    }
    forward = !forward;
    ++s.pass;
    if (!progressed) {
      throw std::runtime_error("emulator: block (" + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) +
                               "," + std::to_string(block_idx.z) + ") deadlocked: some threads wait at a barrier "
                               "others never reach");
    }
  }
  // Arrivals that no wait took: a named barrier left part-way when the block ends means its
  // arrivals and waits are out of step (a turn-taking protocol one turn short, say).
  for (int id = 1; id < 16; ++id) {
    if (s.named[id].arrived != 0) {
      throw std::runtime_error("emulator: block (" + std::to_string(block_idx.x) + "," +
                               std::to_string(block_idx.y) + "," + std::to_string(block_idx.z) +
                               ") ended with named barrier " + std::to_string(id) + " part-way: " +
                               std::to_string(s.named[id].arrived) + " of " + std::to_string(s.named[id].threads) +
                               " threads arrived");
    }
  }
}

}  // namespace

void launch(dim3 grid, dim3 block, std::size_t smem, const std::function<void()>& body) {
  const int threads = static_cast<int>(block.x * block.y * block.z);
  if (threads <= 0 || threads > 1024) throw std::runtime_error("emulator: bad block size");
  if (smem > block_smem_limit) throw std::runtime_error("emulator: more shared memory than a block can have");
  grid_dim = grid;
  block_dim = block;
  s.body = &body;
  s.error.clear();
  while (static_cast<int>(s.fibers.size()) < threads) {
    s.fibers.emplace_back();
    s.fibers.back().stack.reset(new char[kStack]);
  }
  s.slots.assign(static_cast<std::size_t>(threads) * kSlot, 0);
  std::vector<std::uint64_t> order(std::size_t{grid.x} * grid.y * grid.z);
  std::iota(order.begin(), order.end(), std::uint64_t{0});
  if (block_order_seed != 0) {
    std::mt19937_64 rng(block_order_seed * 0x9e3779b97f4a7c15ULL + block_order_launches++);
    std::shuffle(order.begin(), order.end(), rng);
  }
  for (const std::uint64_t block : order) {
    block_idx = {static_cast<unsigned>(block % grid.x), static_cast<unsigned>(block / grid.x % grid.y),
                 static_cast<unsigned>(block / grid.x / grid.y)};
    // A fresh buffer of exactly the launch's size, so that under AddressSanitizer an
    // access past its end is reported (a reused one's spare capacity would hide it).
    s.smem = std::vector<unsigned char>(smem, 0xff);
    s.async_smem = s.smem;
    s.async_fenced = false;
    run_block(threads);
  }
}

void* dynamic_smem() { return s.smem.data(); }

void fence_proxy_async() { s.async_fenced = true; }

namespace {
// Shared memory as an async-proxy read sees it now (see State::async_smem).
const unsigned char* async_view() {
  if (s.async_fenced) {
    s.async_smem = s.smem;
    s.async_fenced = false;
  }
  return s.async_smem.data();
}

// The running thread arrives at barrier b (the block's, its warp's or its warpgroup's) and,
// unless it is the last to arrive, waits there. Only the block's orders memory (`order`).
void arrive_and_wait(Barrier& b, Wait kind, Ordering* order = nullptr) {
  auto& f = s.fibers[s.current];
  f.gen = b.gen;
  if (order != nullptr) release(*order);
  if (b.arrive()) {
    if (order != nullptr) {
      complete(*order);
      acquire(*order);
    }
    return;
  }
  f.wait = kind;
  yield();
  if (order != nullptr) acquire(*order);
}
void sync_group() { arrive_and_wait(s.groups[s.current / 128], Wait::kGroup); }
}  // namespace

void sync_threads() { arrive_and_wait(s.block, Wait::kBlock, &s.block_order); }
void sync_warp() { arrive_and_wait(s.warps[s.current / 32], Wait::kWarp); }

int lane() { return s.current % 32; }

void warp_exchange(const void* mine, void* out, int src, std::size_t bytes) {
  if (bytes > kSlot) throw std::runtime_error("emulator: exchange too large");
  const int base = s.current / 32 * 32;
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], mine, bytes);
  sync_warp();
  std::memcpy(out, &s.slots[static_cast<std::size_t>(base + (src & 31)) * kSlot], bytes);
  sync_warp();
}

namespace {
float element(std::uint32_t reg, int half, bool bf16) {
  const auto bits = static_cast<unsigned short>(half == 0 ? (reg & 0xffffu) : (reg >> 16));
  if (bf16) {
    std::uint32_t f = static_cast<std::uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &f, 4);
    return v;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
}  // namespace

void mma_m16n8k16(float d[4], const std::uint32_t a[4], const std::uint32_t b[2], const float c[4], bool bf16) {
  struct Frag {
    std::uint32_t a[4], b[2];
  };
  static_assert(sizeof(Frag) <= kSlot, "fragment slot");
  const int base = s.current / 32 * 32;
  Frag mine;
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], &mine, sizeof(Frag));
  sync_warp();
  // A (16 x 16, row-major): lane l = 4 g + t holds a0: (g, 2t..2t+1), a1: (g+8, 2t..),
  // a2: (g, 2t+8..), a3: (g+8, 2t+8..). B (16 x 8): b0: (k 2t..2t+1, n g), b1: (k 2t+8.., n g).
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    Frag f;
    std::memcpy(&f, &s.slots[static_cast<std::size_t>(base + l) * kSlot], sizeof(Frag));
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = element(f.a[0], h, bf16);
      A[g + 8][2 * t + h] = element(f.a[1], h, bf16);
      A[g][2 * t + 8 + h] = element(f.a[2], h, bf16);
      A[g + 8][2 * t + 8 + h] = element(f.a[3], h, bf16);
      B[2 * t + h][g] = element(f.b[0], h, bf16);
      B[2 * t + 8 + h][g] = element(f.b[1], h, bf16);
    }
  }
  sync_warp();
  // C/D (16 x 8): c0, c1: (g, 2t..2t+1); c2, c3: (g+8, 2t..2t+1).
  const int l = s.current - base, g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    d[i] = acc;
  }
}

void ldmatrix_x4(std::uint32_t out[4], const void* row, bool trans) {
  const auto* addr = static_cast<const unsigned char*>(row);
  if ((reinterpret_cast<std::uintptr_t>(addr) & 15) != 0) {
    throw std::runtime_error("emulator: ldmatrix row not 16-byte aligned");
  }
  if (addr < s.smem.data() || addr + 16 > s.smem.data() + s.smem.size()) {
    throw std::runtime_error("emulator: ldmatrix row outside the dynamic shared memory");
  }
  check_ordered(static_cast<std::size_t>(addr - s.smem.data()), 16, "ldmatrix");
  const int base = s.current / 32 * 32, l = s.current - base, g = l / 4, t = l % 4;
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], &row, sizeof(row));
  sync_warp();
  auto row_of = [&](int m, int r) {  // the 8 elements of row r of matrix m
    const unsigned char* p;
    std::memcpy(&p, &s.slots[static_cast<std::size_t>(base + 8 * m + r) * kSlot], sizeof(p));
    return reinterpret_cast<const std::uint16_t*>(p);
  };
  for (int m = 0; m < 4; ++m) {
    const std::uint16_t lo = trans ? row_of(m, 2 * t)[g] : row_of(m, g)[2 * t];
    const std::uint16_t hi = trans ? row_of(m, 2 * t + 1)[g] : row_of(m, g)[2 * t + 1];
    out[m] = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  }
  sync_warp();
}

void stmatrix_x4(const std::uint32_t in[4], void* row, bool trans) {
  auto* addr = static_cast<unsigned char*>(row);
  if ((reinterpret_cast<std::uintptr_t>(addr) & 15) != 0) {
    throw std::runtime_error("emulator: stmatrix row not 16-byte aligned");
  }
  if (addr < s.smem.data() || addr + 16 > s.smem.data() + s.smem.size()) {
    throw std::runtime_error("emulator: stmatrix row outside the dynamic shared memory");
  }
  const int base = s.current / 32 * 32, l = s.current - base, m = l / 8, i = l % 8;
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], in, 4 * sizeof(std::uint32_t));
  sync_warp();
  std::uint16_t out[8];
  for (int c = 0; c < 8; ++c) {
    // Element (r, k) of matrix m is in lane 4 r + k / 2, register m, half k % 2; this lane
    // stores row i of matrix m, or with trans its column i.
    const int r = trans ? c : i, k = trans ? i : c;
    std::uint32_t reg;
    std::memcpy(&reg, &s.slots[static_cast<std::size_t>(base + 4 * r + k / 2) * kSlot + 4 * m], sizeof reg);
    out[c] = static_cast<std::uint16_t>(k % 2 ? reg >> 16 : reg & 0xffffu);
  }
  sync_warp();
  std::memcpy(addr, out, sizeof out);
}

cudaError_t get_last_error() { return cudaSuccess; }
cudaError_t func_set_attribute(cudaFuncAttribute attr, int value) {
  // As on a GPU: more dynamic shared memory than a block can have is an invalid value.
  const bool too_much = attr == cudaFuncAttributeMaxDynamicSharedMemorySize &&
                        (value < 0 || static_cast<std::size_t>(value) > block_smem_limit);
  return too_much ? cudaErrorInvalidValue : cudaSuccess;
}
cudaError_t get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount           ? 4
           : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? static_cast<int>(block_smem_limit)
                                                             : 0;
  return cudaSuccess;
}

// ---- wgmma ---------------------------------------------------------------------------------
std::uint32_t shared_address(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (b < s.smem.data() || b >= s.smem.data() + s.smem.size()) {
    throw std::runtime_error("emulator: wgmma descriptor of an address outside the dynamic shared memory");
  }
  return static_cast<std::uint32_t>(b - s.smem.data());
}

namespace {

// A matrix descriptor of 16-bit elements, no swizzle or 128-byte swizzle (the PTX ISA's
// canonical layouts, in bytes).
// No swizzle: 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16 bytes), adjacent
// ones lbo bytes apart along K and sbo along M or N. K-major: a core matrix's rows run
// along M/N and its 16 bytes along K; MN-major the other way round.
// 128-byte swizzle: rows of 128 bytes (64 elements) along K (K-major) or M/N (MN-major),
// 8 rows to an atom of 1024 bytes; K-major: row = M/N, atoms sbo apart along M/N (lbo
// unused); MN-major: row = K, atoms sbo apart along K and lbo apart per 64 of M/N. The
// address's bits 4-6 are then XORed with its bits 7-9 (the 16-byte chunk with the row
// within the atom), as the copy that wrote the tile did.
struct Desc {
  std::uint32_t start, lbo, sbo;
  bool swizzle128;
};

Desc decode(std::uint64_t d) {
  const auto mode = d >> 62;
  if (mode != 0 && mode != 1) throw std::runtime_error("emulator: 32- and 64-byte swizzled wgmma descriptors are not emulated");
  if (((d >> 49) & 7) != 0) throw std::runtime_error("emulator: wgmma descriptor with a base offset");
  return {static_cast<std::uint32_t>(d & 0x3fff) << 4, static_cast<std::uint32_t>((d >> 16) & 0x3fff) << 4,
          static_cast<std::uint32_t>((d >> 32) & 0x3fff) << 4, mode == 1};
}

std::size_t swizzle128(std::size_t off) { return off ^ (((off >> 7) & 7) << 4); }

// The element's offset before the swizzle (which moves it only within its 128-byte row).
std::size_t desc_offset(const Desc& d, int mn, int k, bool mn_major) {
  if (d.swizzle128) {
    return std::size_t{d.start} + (mn_major ? std::size_t(mn / 64) * d.lbo + (mn % 64) * 2 + (k % 8) * 128 +
                                                  std::size_t(k / 8) * d.sbo
                                            : std::size_t(mn / 8) * d.sbo + (mn % 8) * 128 + k * 2);
  }
  return std::size_t{d.start} + std::size_t(mn / 8) * d.sbo + std::size_t(k / 8) * d.lbo +
         (mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2);
}

// An operand element from mem, the async proxy's view of shared memory.
float desc_element(const unsigned char* mem, const Desc& d, int mn, int k, bool mn_major, bool bf16) {
  std::size_t off = desc_offset(d, mn, k, mn_major);
  if (d.swizzle128) off = swizzle128(off);
  if (off + 2 > s.smem.size()) throw std::runtime_error("emulator: wgmma operand past the dynamic shared memory");
  std::uint16_t bits;
  std::memcpy(&bits, mem + off, 2);
  return element(bits, 0, bf16);
}

bool same_shape(const WgmmaOp& a, const WgmmaOp& b) {
  return a.n == b.n && a.a_regs == b.a_regs && (a.a_regs || a.desc_a == b.desc_a) && a.desc_b == b.desc_b &&
         a.trans_b == b.trans_b && a.accumulate == b.accumulate && a.bf16 == b.bf16;
}

// This thread's part of op i: its rows of d += A B.
void wgmma_product(std::size_t i, bool check_before) {
  const int me = s.current, base = me / 128 * 128, w = (me - base) / 32, l = me % 32, g = l / 4, t = l % 4;
  const WgmmaOp& op = s.wgmma[me].ops[i];
  if (check_before && std::memcmp(op.d, op.before.data(), op.before.size() * sizeof(float)) != 0) {
    throw std::runtime_error("emulator: wgmma accumulators changed between the issue and the wait");
  }
  if (op.a_regs && std::memcmp(op.a_src, op.a, sizeof(op.a)) != 0) {
    throw std::runtime_error("emulator: wgmma A fragment registers changed between the issue and the wait");
  }
  const unsigned char* mem = async_view();
  float A[16][16];
  std::vector<float> B(static_cast<std::size_t>(16) * op.n);
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) {
      if (op.a_regs) {  // mma.sync's A fragment: lane 4 (r % 8) + (k % 8) / 2, register r / 8 + 2 (k / 8)
        const auto& src = s.wgmma[base + 32 * w + 4 * (r % 8) + (k % 8) / 2].ops[i];
        A[r][k] = element(src.a[r / 8 + 2 * (k / 8)], k % 2, op.bf16);
      } else {
        A[r][k] = desc_element(mem, decode(op.desc_a), 16 * w + r, k, false, op.bf16);
      }
    }
  }
  const Desc db = decode(op.desc_b);
  for (int k = 0; k < 16; ++k) {
    for (int c = 0; c < op.n; ++c) {
      B[static_cast<std::size_t>(k) * op.n + c] = desc_element(mem, db, c, k, op.trans_b, op.bf16);
    }
  }
  for (int j = 0; j < op.n / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e / 2), c = 8 * j + 2 * t + (e & 1);
      float acc = 0.f;
      for (int k = 0; k < 16; ++k) acc += A[r][k] * B[static_cast<std::size_t>(k) * op.n + c];
      float& out = op.d[4 * j + e];
      out = (op.accumulate ? out : 0.f) + acc;
    }
  }
}

}  // namespace

void wgmma(float* d, int n, std::uint64_t desc_a, const std::uint32_t* a_regs, std::uint64_t desc_b, bool trans_b,
           bool accumulate, bool bf16) {
  const int me = s.current, base = me / 128 * 128;
  auto& th = s.wgmma[me];
  if (base + 128 > static_cast<int>(block_dim.x * block_dim.y * block_dim.z)) {
    throw std::runtime_error("emulator: wgmma outside a whole warpgroup");
  }
  if (n % 8 != 0 || n < 8 || n > 256) throw std::runtime_error("emulator: wgmma N must be a multiple of 8 up to 256");
  if (!th.fenced) throw std::runtime_error("emulator: wgmma with no wgmma_fence since the last wait (or the start)");
  for (auto it = th.ops.rbegin(); it != th.ops.rend(); ++it) {
    if (it->d == d && std::memcmp(d, it->before.data(), it->before.size() * sizeof(float)) != 0) {
      throw std::runtime_error("emulator: wgmma accumulators changed while a wgmma on them was in flight");
    }
    if (it->d == d) break;
  }
  if (lane() == 0) {  // the operands in shared memory, as the whole warpgroup's operation reads them
    auto check = [](std::uint64_t desc, int mn, bool mn_major) {
      const Desc dd = decode(desc);
      for (int r = 0; r < mn; ++r) {
        for (int k = 0; k < 16; ++k) {
          std::size_t off = desc_offset(dd, r, k, mn_major);
          if (dd.swizzle128) off = swizzle128(off);
          check_ordered(off, 2, "a wgmma");
        }
      }
    };
    if (a_regs == nullptr) check(desc_a, 64, false);
    check(desc_b, n, trans_b);
  }
  WgmmaOp op{d, n, desc_a, desc_b, {0, 0, 0, 0}, a_regs, a_regs != nullptr, trans_b, accumulate, bf16,
             std::vector<float>(d, d + n / 2), 0};
  if (a_regs) std::memcpy(op.a, a_regs, sizeof(op.a));
  th.ops.push_back(std::move(op));
  sync_group();
  // The group's first thread may have run on to its next wgmma since the barrier (not
  // past a wait, which needs everyone): compare the op at this one's index.
  const auto& first = s.wgmma[base].ops;
  const std::size_t i = th.ops.size() - 1;
  if (first.size() <= i || !same_shape(first[i], th.ops[i])) {
    throw std::runtime_error("emulator: the threads of a warpgroup issued different wgmma (shape, operands or count)");
  }
}

void wgmma_fence() { s.wgmma[s.current].fenced = true; }

void wgmma_commit() { commit_group(s.wgmma[s.current]); }

void wgmma_wait(int pending) {
  auto& th = s.wgmma[s.current];
  sync_group();  // every thread of the group has issued what precedes this wait
  const int upto = th.commits - pending;
  std::size_t done = 0;
  while (done < th.ops.size() && th.ops[done].group > 0 && th.ops[done].group <= upto) {
    bool first_on_d = true;
    for (std::size_t i = 0; i < done; ++i) first_on_d = first_on_d && th.ops[i].d != th.ops[done].d;
    wgmma_product(done, first_on_d);
    ++done;
  }
  sync_group();  // every thread has read the others' A fragments
  th.ops.erase(th.ops.begin(), th.ops.begin() + static_cast<std::ptrdiff_t>(done));
  th.fenced = false;
}

// ---- TMA and mbarrier ----------------------------------------------------------------------
void encode_tensor_map(void* map, const TensorMap& m) {
  static_assert(sizeof(TensorMap) <= 128, "a CUtensorMap holds 128 bytes");
  auto bad = [](const std::string& what) { throw std::runtime_error("emulator: tensor map: " + what); };
  if (m.rank < 1 || m.rank > 5) bad("rank must be 1..5");
  if (reinterpret_cast<std::uintptr_t>(m.base) % 16 != 0) bad("global address not 16-byte aligned");
  if (m.swizzle != 0 && m.swizzle != 128) bad("only no swizzle and the 128-byte swizzle are emulated");
  if (m.strides[0] != static_cast<std::uint64_t>(m.elem_bytes)) bad("dimension 0 must be contiguous");
  for (int i = 0; i < m.rank; ++i) {
    if (m.dims[i] == 0 || m.box[i] == 0 || m.box[i] > 256) bad("dimensions must be positive, boxes 1..256");
    if (i > 0 && m.strides[i] % 16 != 0) bad("strides must be multiples of 16 bytes");
  }
  if (m.box[0] * m.elem_bytes % 16 != 0) bad("the box's inner extent must be a multiple of 16 bytes");
  if (m.swizzle == 128 && m.box[0] * m.elem_bytes > 128) bad("a 128-byte swizzle needs an inner box of at most 128 bytes");
  std::memset(map, 0, 128);
  std::memcpy(map, &m, sizeof(m));
}

namespace {
Mbarrier& mbarrier_at(void* bar, const char* what) {
  const std::uint32_t off = shared_address(bar);
  if (off % 8 != 0) throw std::runtime_error(std::string("emulator: ") + what + ": mbarrier not 8-byte aligned");
  auto it = s.mbarriers.find(off);
  if (it == s.mbarriers.end()) throw std::runtime_error(std::string("emulator: ") + what + " on an mbarrier never initialised");
  return it->second;
}

void complete_if_done(Mbarrier& m) {
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.count;
    complete(m.order);
  }
}

void arrive(Mbarrier& m, const char* what) {
  if (m.pending == 0) throw std::runtime_error(std::string("emulator: ") + what + ": more arrivals than the mbarrier's count");
  release(m.order);
  --m.pending;
  complete_if_done(m);
}

void land_copies(Mbarrier& m) {
  auto copies = std::move(m.copies);
  m.copies.clear();
  for (const auto& c : copies) {
    const TensorMap& t = c.map;
    std::uint64_t elems = 1;
    for (int i = 0; i < t.rank; ++i) elems *= t.box[i];
    const std::uint64_t bytes = elems * t.elem_bytes;
    if (c.dst + bytes > s.smem.size()) throw std::runtime_error("emulator: TMA box past the dynamic shared memory");
    attribute(c.dst, c.dst + (bytes + 127) / 128 * 128);  // the running warp's stores before the copy's
    for (std::uint64_t e = 0; e < elems; ++e) {
      std::uint64_t rest = e;
      bool inside = true;
      const unsigned char* src = static_cast<const unsigned char*>(t.base);
      for (int i = 0; i < t.rank; ++i) {
        const std::int64_t x = std::int64_t{c.coords[i]} + static_cast<std::int64_t>(rest % t.box[i]);
        rest /= t.box[i];
        inside = inside && x >= 0 && static_cast<std::uint64_t>(x) < t.dims[i];
        if (inside) src += x * static_cast<std::int64_t>(t.strides[i]);
      }
      std::size_t off = c.dst + e * t.elem_bytes;
      if (t.swizzle == 128) off = swizzle128(off);
      // The async proxy's own write, which the race check takes as no warp's.
      for (unsigned char* mem : {s.smem.data(), s.async_smem.data(), s.seen.data()}) {
        if (inside) {
          std::memcpy(mem + off, src, t.elem_bytes);
        } else {
          std::memset(mem + off, 0, t.elem_bytes);
        }
      }
      std::fill_n(&s.writer[off], t.elem_bytes, 0);
    }
    m.tx -= static_cast<std::int64_t>(bytes);
  }
  complete_if_done(m);
}
}  // namespace

void mbarrier_init(void* bar, int count) {
  const std::uint32_t off = shared_address(bar);
  if (off % 8 != 0) throw std::runtime_error("emulator: mbarrier_init: not 8-byte aligned");
  if (count < 1) throw std::runtime_error("emulator: mbarrier_init: count must be positive");
  Mbarrier m;
  m.count = m.pending = count;
  s.mbarriers[off] = std::move(m);
}

// An arrival lets the other warpgroups run before this thread goes on (till the next pass),
// so that what it released (a buffer, say) is used while this thread's work is in flight.
void mbarrier_arrive(void* bar) {
  arrive(mbarrier_at(bar, "mbarrier_arrive"), "mbarrier_arrive");
  auto& f = s.fibers[s.current];
  f.gen = s.pass;
  f.wait = Wait::kPass;
  yield();
}

void mbarrier_arrive_expect_tx(void* bar, std::uint32_t bytes) {
  auto& m = mbarrier_at(bar, "mbarrier_arrive_expect_tx");
  m.tx += bytes;
  arrive(m, "mbarrier_arrive_expect_tx");
}

void mbarrier_wait(void* bar, int parity) {
  auto& m = mbarrier_at(bar, "mbarrier_wait");
  land_copies(m);
  if (static_cast<int>(m.phase & 1) != (parity & 1)) {
    acquire(m.order);
    return;
  }
  auto& f = s.fibers[s.current];
  f.mbarrier = shared_address(bar);
  f.parity = parity & 1;
  f.wait = Wait::kMbarrier;
  yield();
  acquire(m.order);
}

void tma_load(void* dst, const void* map, const int* coords, void* bar) {
  TmaCopy c;
  std::memcpy(&c.map, map, sizeof(TensorMap));
  if (c.map.rank < 1 || c.map.rank > 5 || c.map.base == nullptr) {
    throw std::runtime_error("emulator: tma_load with a tensor map encode_tensor_map did not fill");
  }
  std::memcpy(c.coords, coords, sizeof(int) * c.map.rank);
  c.dst = shared_address(dst);
  if (c.dst % (c.map.swizzle == 128 ? 1024 : 128) != 0) {
    throw std::runtime_error("emulator: tma_load destination not 128-byte aligned (1024 with the 128-byte swizzle)");
  }
  // The copy may land at any time from now: no wgmma still in flight may read its bytes.
  std::size_t bytes = c.map.elem_bytes;
  for (int i = 0; i < c.map.rank; ++i) bytes *= c.map.box[i];
  auto overlaps = [&](std::uint64_t desc, int mn, bool mn_major) {
    const Desc d = decode(desc);
    std::size_t lo = desc_offset(d, 0, 0, mn_major), hi = desc_offset(d, mn - 1, 15, mn_major) + 2;
    if (d.swizzle128) lo = lo / 128 * 128, hi = (hi + 127) / 128 * 128;
    return lo < c.dst + bytes && c.dst < hi;
  };
  for (const auto& th : s.wgmma) {
    for (const auto& op : th.ops) {
      if ((!op.a_regs && overlaps(op.desc_a, 64, false)) || overlaps(op.desc_b, op.n, op.trans_b)) {
        throw std::runtime_error("emulator: tma_load into shared memory that a wgmma in flight reads");
      }
    }
  }
  mbarrier_at(bar, "tma_load").copies.push_back(c);
}

void bulk_reduce_add_f32(float* dst, const void* src, std::uint32_t bytes) {
  const std::uint32_t off = shared_address(src);
  if (bytes == 0 || bytes % 16 != 0) throw std::runtime_error("emulator: bulk reduction size must be a positive multiple of 16");
  if (off % 16 != 0 || reinterpret_cast<std::uintptr_t>(dst) % 16 != 0) {
    throw std::runtime_error("emulator: bulk reduction addresses must be 16-byte aligned");
  }
  if (off + bytes > s.smem.size()) throw std::runtime_error("emulator: bulk reduction source past the shared memory");
  check_ordered(off, bytes, "a bulk reduction");
  s.bulk[s.current].ops.push_back({dst, off, bytes, 0});
}

void bulk_commit() { commit_group(s.bulk[s.current]); }

void bulk_wait(int pending) {
  auto& th = s.bulk[s.current];
  const int through = th.commits - pending;  // groups 1..through retire
  std::vector<BulkOp> keep;
  for (const auto& op : th.ops) {
    if (op.group == 0 || op.group > through) {
      keep.push_back(op);
      continue;
    }
    const float* src = reinterpret_cast<const float*>(async_view() + op.src);
    for (std::uint32_t i = 0; i < op.bytes / 4; ++i) op.dst[i] += src[i];
  }
  th.ops = std::move(keep);
}

namespace {
void named_arrive(int id, int threads, bool wait) {
  if (id < 1 || id > 15) throw std::runtime_error("emulator: named barrier id must be 1..15 (0 is __syncthreads')");
  if (threads <= 0 || threads % 32 != 0) throw std::runtime_error("emulator: named barrier thread count must be a multiple of 32");
  auto& b = s.named[id];
  if (b.arrived == 0) b.threads = threads;
  if (b.threads != threads) throw std::runtime_error("emulator: named barrier used with different thread counts");
  auto& f = s.fibers[s.current];
  f.gen = b.gen;
  release(b.order);
  if (++b.arrived == b.threads) {
    b.arrived = 0;
    ++b.gen;
    complete(b.order);
    if (wait) acquire(b.order);
    return;
  }
  if (!wait) return;
  f.named = id;
  f.wait = Wait::kNamed;
  yield();
  acquire(b.order);
}
}  // namespace

void named_barrier_sync(int id, int threads) { named_arrive(id, threads, true); }
void named_barrier_arrive(int id, int threads) { named_arrive(id, threads, false); }

}  // namespace dtrain_emu

extern "C" void dtrain_emu_set_block_smem_limit(size_t bytes) { dtrain_emu::block_smem_limit = bytes; }
extern "C" void dtrain_emu_set_block_order(uint64_t seed) {
  dtrain_emu::block_order_seed = seed;
  dtrain_emu::block_order_launches = 0;
}
