// The fused scan on the GPU: kernels over raw pointers and a stream.
//
// Free of torch headers. The launcher (stats_cuda.cpp) and the standalone
// test program (tests/standalone_test.cu) both include this file: the first part
// (types, constants, the launch plan) is plain host C++ that any compiler
// reads; the kernels below `#if defined(__CUDACC__)` are compiled by nvcc in
// the per-dtype files stats_cuda_<dtype>.cu.
//
// How one call runs. Every tensor is split into tiles, whose size depends on
// the tensor alone (numel and element size). One block reduces one tile to a
// Partial (csrc/stats_record.h) at a time, walking the tiles of a launch in a
// grid-stride loop. A tensor of one tile gets its result row written by that
// block. A tensor of several tiles has its tile partials written to a
// workspace; the block that finishes the tensor's last tile (a per-tensor
// counter says which) combines them in a fixed order and writes the row. So a
// tensor's bits depend on its data, size and address alignment only: not on
// the grid size, the device's SM count, the other tensors of a stats_many
// call, or which block ran which tile.
//
// Within a tile, each thread reduces its share through a Tally (classify.h,
// the CPU's branch-free classification) or, for float32, bfloat16 and
// float16 on sm_80 and later, through a FastTally (fast_tally.cuh), which
// counts the same classes on the float pipes in at most 40 % of the issue
// slots (benchmarks/sass_cost.py); a tile whose fast moments fall short is
// walked again by the Tally (scan_tiles). The one-byte types (float8, bool,
// uint8, int8) count how often each of their 256 values occurs in a shared
// table, and classify each value once per tile (ByteSink). A contiguous
// share is read in 16-byte vectors (walk_contiguous); a strided one in
// groups of single loads inside a row of the innermost dimension, gathered
// into the same vectors (walk_strided).
//
// stats_many_hist launches the same kernels compiled with kHist: each element
// also adds 1 to its histogram field (csrc/histogram.h) in a per-block
// shared-memory table (LaneBins on the fast path, a counter per lane of a
// warp; FieldBins elsewhere), which the block adds to the tensor's int64
// fields in global memory (atomics, times the tensor's repeat) at the end of
// every tile. The fields are integers, so the order of those atomics changes
// nothing. The fast path then takes two of its counts from the table (field
// 0 and the top field, settle_by_fields) instead of counting them; counts are
// exact either way and the moments are summed by the same code, so the rows
// are bitwise those of stats_many. Without kHist not one instruction of it
// is compiled in.
//
// Tensors travel as kernel arguments (up to kContigCapacity contiguous, or
// kStridedCapacity strided ones per launch, with int64 sizes; 32 KiB of
// parameters since CUDA 12.1), in the spirit
// of PyTorch's MultiTensorApply: a list of many tensors is a handful of
// launches and no host-to-device copy, so it can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "../classify.h"
#include "../dtypes.h"
#include "../histogram.h"
#include "../layout.h"
#include "../stats_record.h"
#include "fast_tally.cuh"

namespace zeroscan {
namespace cuda {

constexpr int kThreads = 256;  // per block
constexpr int kUnroll = 4;     // 16-byte loads in flight per thread
// A tile is at least this many bytes, so the per-tile block reduction is a
// small fraction of the time spent streaming it in.
constexpr int64_t kMinTileBytes = int64_t(512) << 10;
// A tensor has at most this many tiles, which bounds the work of the block
// that combines them.
constexpr int64_t kMaxTiles = 8192;
constexpr int64_t kTileAlign = 1024;  // tiles start on 16-byte boundaries
// Strided layouts with more (coalesced) dimensions than this are not walked
// by the kernels; the launcher scans a contiguous copy of such a tensor.
constexpr int kMaxStridedDims = 6;
// Tensors per launch. CUDA 12.1 raised the kernel parameter limit from
// 4 KiB to 32,764 bytes (Volta and later): 2,000 small tensors are then
// three launches, not twenty-one, each with many tensors' tiles at once.
#if CUDART_VERSION >= 12010
constexpr int kContigCapacity = 768;   // contiguous
constexpr int kStridedCapacity = 224;  // strided
constexpr size_t kMaxParamBytes = 32764;
#else
constexpr int kContigCapacity = 96;
constexpr int kStridedCapacity = 28;
constexpr size_t kMaxParamBytes = 4096;
#endif
// A tile holds at most this many positions, so that the walk counts within
// it in 32 bits and the fast path's counts stay exact (float32 per block,
// float16 per thread lane: 2^20 / kThreads / 2 = 2048). Tensors beyond
// kMaxTiles * 2^20 elements get more than kMaxTiles tiles.
constexpr int64_t kMaxTilePositions = int64_t(1) << 20;
// Per-launch limit on tiles, far below int32 overflow.
constexpr int64_t kMaxLaunchTiles = int64_t(1) << 30;

// One tensor of a launch.
struct TensorTiles {
  const void* data;    // where position 0 of the coalesced layout lives
  int64_t numel;       // positions of the coalesced layout
  int64_t repeat;      // how often each position occurs (stride-0 dims)
  int64_t tile;        // positions per tile
  int32_t first_tile;  // index of its first tile among the launch's tiles
  int32_t row;         // output row; also its counter
};

// A strided layout, innermost dimension first, padded with size 1, stride 0.
struct StridedShape {
  int64_t sizes[kMaxStridedDims];
  int64_t strides[kMaxStridedDims];  // in elements
};

struct LaunchHeader {
  int32_t num_tensors = 0;
  int32_t num_tiles = 0;
  int64_t slot_base = 0;  // tile k's partial goes to partials[slot_base + k]
  Limits limits = {};     // the key limits of the launch's dtype and tol
  FastLimits fast = {};   // fast.on: FastTally counts them (fast_tally.cuh)
  int64_t* out = nullptr;         // [rows, kNumFields]
  Partial* partials = nullptr;    // [tiles of the whole call]; may be null
  int32_t* counters = nullptr;    // [rows], zeroed before the call; may be null
  // [rows, hist_width], zeroed before the call; null: no histogram (the
  // kernels without kHist run). hist_width >= Binning<S>::kFields.
  int64_t* hist = nullptr;
  int64_t hist_width = 0;
};

struct ContigBatch {
  LaunchHeader h;
  TensorTiles t[kContigCapacity];
};

struct StridedBatch {
  LaunchHeader h;
  TensorTiles t[kStridedCapacity];
  StridedShape shape[kStridedCapacity];
};

static_assert(sizeof(ContigBatch) <= kMaxParamBytes, "ContigBatch exceeds the kernel parameter limit");
static_assert(sizeof(StridedBatch) <= kMaxParamBytes, "StridedBatch exceeds the kernel parameter limit");

// Each launches one kernel on `stream` and returns without synchronising;
// the caller checks cudaGetLastError. `grid` may be any positive number.
// batch.h.hist picks the kernel: with a histogram (kHist) or without.
// Instantiated for every storage type in stats_cuda_<dtype>.cu.
template <typename T>
void launch_contig(const ContigBatch& batch, int grid, cudaStream_t stream);
template <typename T>
void launch_strided(const StridedBatch& batch, int grid, cudaStream_t stream);

// rows: int64 [w, n, kNumFields] on the device, combined in place (each
// tensor's w rows in the tree of stats_record.h); its row 0 becomes the
// result. One thread per tensor. Defined in stats_cuda_combine.cu.
void launch_combine_rows(int64_t* rows, int64_t w, int64_t n, cudaStream_t stream);

// One per dtype of the table in dtypes.h.
#define ZEROSCAN_DECLARE_LAUNCHERS(name, S, value_t, tiny, eps)          \
  extern template void launch_contig<S>(const ContigBatch&, int,         \
                                        cudaStream_t);                    \
  extern template void launch_strided<S>(const StridedBatch&, int,       \
                                         cudaStream_t);
ZEROSCAN_DTYPES(ZEROSCAN_DECLARE_LAUNCHERS)
#undef ZEROSCAN_DECLARE_LAUNCHERS

// ---- The launch plan (host side, shared by the launcher and the test) -----

// Positions per tile of a tensor: a function of the tensor alone.
inline int64_t tile_positions(int64_t numel, int64_t elem_size) {
  const int64_t by_bytes = kMinTileBytes / elem_size;
  const int64_t by_count = (numel + kMaxTiles - 1) / kMaxTiles;
  const int64_t t = by_bytes > by_count ? by_bytes : by_count;
  const int64_t aligned = (t + kTileAlign - 1) / kTileAlign * kTileAlign;
  return aligned < kMaxTilePositions ? aligned : kMaxTilePositions;
}

// An empty tensor still gets one (empty) tile, whose block writes its row.
inline int64_t tile_count(int64_t numel, int64_t tile) {
  return numel == 0 ? 1 : (numel + tile - 1) / tile;
}

inline int64_t tiles_of(const Layout& l, int64_t elem_size) {
  return tile_count(l.numel, tile_positions(l.numel, elem_size));
}

// Whether the kernels can walk a layout in place.
inline bool walkable(const Layout& l) {
  return l.numel == 0 || l.contiguous() || l.ndim <= kMaxStridedDims;
}

// Whether a block's uint32 histogram counts of one tile of this layout
// cannot overflow: a tile of at most 2^32 - 1 positions, i.e. numel up to
// about kMaxTiles * 2^32 = 2^45 distinct positions (more than any device
// holds; overlapping views could ask for more).
inline bool hist_countable(const Layout& l, int64_t elem_size) {
  return tile_positions(l.numel, elem_size) <= int64_t(UINT32_MAX);
}

// One tensor to scan: its layout (from plan_layout) and where it starts.
struct ScanInput {
  const void* data;
  const Layout* layout;  // must be walkable()
  int32_t row;
};

// Packs `inputs` (all of one storage type, elem_size bytes each) into
// launches: `contig(const ContigBatch&)` and `strided(const StridedBatch&)`
// are called once per full batch and once for each last one. `common`
// supplies the key limits and buffers; `slot_cursor` numbers tiles across all
// launches of one call (start it at 0, and size the partials buffer by the sum
// of tiles_of over the call).
template <typename LaunchContig, typename LaunchStrided>
void plan_launches(const ScanInput* inputs, int64_t n, int64_t elem_size,
                   const LaunchHeader& common, int64_t& slot_cursor,
                   LaunchContig&& contig, LaunchStrided&& strided) {
  ContigBatch cb;
  StridedBatch sb;
  cb.h = common;
  sb.h = common;
  cb.h.num_tensors = cb.h.num_tiles = 0;
  sb.h.num_tensors = sb.h.num_tiles = 0;

  auto flush = [&](LaunchHeader& h, auto& launch, auto& batch) {
    if (h.num_tensors == 0) return;
    h.slot_base = slot_cursor;
    slot_cursor += h.num_tiles;
    launch(batch);
    h.num_tensors = 0;
    h.num_tiles = 0;
  };

  for (int64_t k = 0; k < n; ++k) {
    const Layout& l = *inputs[k].layout;
    const int64_t tile = tile_positions(l.numel, elem_size);
    const int64_t tiles = tile_count(l.numel, tile);
    const bool contiguous = l.numel == 0 || l.contiguous();
    LaunchHeader& h = contiguous ? cb.h : sb.h;
    const int capacity = contiguous ? kContigCapacity : kStridedCapacity;
    if (h.num_tensors == capacity || h.num_tiles + tiles > kMaxLaunchTiles) {
      if (contiguous) {
        flush(cb.h, contig, cb);
      } else {
        flush(sb.h, strided, sb);
      }
    }
    TensorTiles& t = contiguous ? cb.t[h.num_tensors] : sb.t[h.num_tensors];
    t.data = inputs[k].data;
    t.numel = l.numel;
    t.repeat = l.repeat;
    t.tile = tile;
    t.first_tile = h.num_tiles;
    t.row = inputs[k].row;
    if (!contiguous) {
      StridedShape& s = sb.shape[h.num_tensors];
      for (int d = 0; d < kMaxStridedDims; ++d) {
        const bool real = d < l.ndim;
        s.sizes[d] = real ? l.sizes[l.ndim - 1 - d] : 1;
        s.strides[d] = real ? l.strides[l.ndim - 1 - d] : 0;
      }
    }
    h.num_tensors += 1;
    h.num_tiles += static_cast<int32_t>(tiles);
  }
  flush(cb.h, contig, cb);
  flush(sb.h, strided, sb);
}

}  // namespace cuda
}  // namespace zeroscan

// ---- Device code ----------------------------------------------------------
#if defined(__CUDACC__)

#include <cub/block/block_reduce.cuh>

// The per-thread code is __host__ __device__ so that the standalone test can
// also run it on the CPU (standalone_test --emulate); only the block-level
// parts (block reduction, atomics, the kernels) are device-only.
#define ZS_HDI __host__ __device__ __forceinline__
#define ZS_DEV __device__ __forceinline__

namespace zeroscan {
namespace cuda {

// Tensor data is read through the read-only path (__ldg) and nothing else
// is: benchmarks/sass_cost.py finds the kernels' hot loops by these loads.
// A 16-byte load of data nobody writes during the kernel.
ZS_HDI uint4 load16(const uint4* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// One element of type T, through the same path.
template <typename T>
ZS_HDI T load_element(const T* p) {
#if defined(__CUDA_ARCH__)
  using U = UnsignedOf<sizeof(T)>;
  U bits;
  if constexpr (sizeof(T) == 8) {
    bits = __ldg(reinterpret_cast<const unsigned long long*>(p));
  } else if constexpr (sizeof(T) == 4) {
    bits = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else if constexpr (sizeof(T) == 2) {
    bits = __ldg(reinterpret_cast<const unsigned short*>(p));
  } else {
    bits = __ldg(reinterpret_cast<const unsigned char*>(p));
  }
  return storage_of_bits<T>(bits);
#else
  return *p;
#endif
}

// Word i of a 16-byte vector; i is a compile-time constant after unrolling,
// so this is a register pick, never a memory access.
ZS_HDI uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Element k of a 16-byte vector holding elements of type T.
template <typename T>
ZS_HDI T element(const uint4& v, int k) {
  if constexpr (sizeof(T) == 8) {
    return storage_of_bits<T>((static_cast<uint64_t>(word(v, 2 * k + 1)) << 32) | word(v, 2 * k));
  } else if constexpr (sizeof(T) == 4) {
    return storage_of_bits<T>(word(v, k));
  } else if constexpr (sizeof(T) == 2) {
    return storage_of_bits<T>(static_cast<uint16_t>(word(v, k / 2) >> (16 * (k % 2))));
  } else {
    return storage_of_bits<T>(static_cast<uint8_t>(word(v, k / 4) >> (8 * (k % 4))));
  }
}

// Where a thread's elements' histogram fields go. NoFields: nowhere, the
// scan of stats/stats_many, which compiles to exactly what it was before
// histograms existed.
struct NoFields {
  template <typename T>
  ZS_HDI void count(T) const {}
  template <typename T>
  ZS_HDI void count_n(T, uint32_t) const {}
  ZS_HDI NoFields muted() const { return *this; }
};

// One increment per element, of bins[Binning<T>::field(key of |x|)]: a
// block's shared-memory table on the device (shared atomics, as the threads
// of a block share it), a plain table on the host (standalone_test
// --emulate, which runs one thread at a time). `weight` is 1, or 0 on a
// float64 thread's second, downscaled walk of its share (thread_partial),
// whose elements were counted on the first.
template <typename T>
ZS_HDI void flush_bins(const LaunchHeader& h, const TensorTiles& t, uint32_t* bins, int tid);

// Adds c elements, times the tensor's repeat, to field f of tensor t's
// histogram (row t.row of h.hist): other blocks add to the same fields,
// hence the atomic (integer: the order changes nothing).
ZS_HDI void add_to_field(const LaunchHeader& h, const TensorTiles& t, int f, uint32_t c) {
  int64_t* out = h.hist + static_cast<int64_t>(t.row) * h.hist_width + f;
  const unsigned long long add = static_cast<unsigned long long>(c) * static_cast<unsigned long long>(t.repeat);
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(out), add);
#else
  *out += static_cast<int64_t>(add);
#endif
}

// The sum of a row of 32 per-lane counters, which are zeroed for the next
// tile. Thread `rotate` reads them from lane `rotate` on, so the threads of a
// warp, each on its own row, read 32 different banks at a time.
ZS_HDI uint32_t take_lanes(uint32_t* row, int rotate) {
  uint32_t n = 0;
#pragma unroll 8
  for (int l = 0; l < 32; ++l) {
    const int at = (l + rotate) & 31;
    n += row[at];
    row[at] = 0;
  }
  return n;
}

#if defined(__CUDA_ARCH__)
template <typename Bins>
__device__ uint32_t* block_bins();
#endif

template <typename T>
struct FieldBins {
  static constexpr int kWords = Binning<T>::kFields;
  uint32_t* bins;  // [kWords]
  uint32_t weight;

  ZS_HDI static FieldBins make(uint32_t* table, int) { return FieldBins{table, 1u}; }

  ZS_HDI void count(T x) const { add(Binning<T>::field(Format<T>::key(x)), weight); }
  // n elements of value x (the one-byte types' value table, ByteSink).
  ZS_HDI void count_n(T x, uint32_t n) const { add(Binning<T>::field(Format<T>::key(x)), n * weight); }
  ZS_HDI FieldBins muted() const { return FieldBins{bins, 0u}; }
  // Adds the block's table to the tensor's fields (see flush_bins).
  ZS_HDI void flush(const LaunchHeader& h, const TensorTiles& t, int tid) const { flush_bins<T>(h, t, bins, tid); }

 private:
  // A shared-memory reduction: the table is the block's (a generic atomic
  // would cost an address-space check per element).
  ZS_HDI void add(int f, uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(bins + f));
    asm volatile("red.shared.add.u32 [%0], %1;" : : "r"(at), "r"(n));
#else
    bins[f] += n;
#endif
  }
};

// The fast path's histogram table (float32, bfloat16, float16): each
// field's counter split over the 32 lanes of a warp ([field][lane] uint32, a
// field every kStride bytes), so that the lanes of a warp never share a
// counter or a bank however alike their values (a tile of zeros counts all
// of them in field 0), and so that a field's byte offset is the element's
// exponent bits masked where they lie (kMask): one LOP3 an element (float32's
// after a shift; a 16-bit word's high element after a move to the low lane
// on the 16-bit float pipe, high_lane_low). flush adds the lanes up.
template <typename T>
struct LaneBins {
  // float32's exponent (in its high half) and bfloat16's sit at bit 7,
  // float16's at bit 10.
  static constexpr uint32_t kStride = std::is_same_v<T, f16_t> ? 1024u : 128u;
  static constexpr uint32_t kMask = (Binning<T>::kFields - 1) * kStride;
  static constexpr int kWords = static_cast<int>(Binning<T>::kFields * kStride / 4);  // 32 KiB
  uint32_t* bins;   // [kWords]: the block's table (block_bins)
  uint32_t lane4;   // the thread's lane times 4
  uint32_t weight;

  ZS_HDI static LaneBins make(uint32_t* table, int tid) {
    return LaneBins{table, static_cast<uint32_t>(tid & 31) * 4u, 1u};
  }
  ZS_HDI void count(T x) const { at(static_cast<uint32_t>(Binning<T>::field(Format<T>::key(x))) * kStride); }
  // A float32 by its bits; a word of two 16-bit elements.
  ZS_HDI void count_bits32(uint32_t bits) const { at((bits >> 16) & kMask); }
  ZS_HDI void count_word16(uint32_t w) const {
    at(w & kMask);
    at(high_lane_low(w) & kMask);
  }
  ZS_HDI LaneBins muted() const { return LaneBins{bins, lane4, 0u}; }

  // Field f's count, lane `lane`'s share; all lanes' (the emulation's
  // settle_from_table).
  ZS_HDI uint32_t share(int f, int lane) const { return bins[f * static_cast<int>(kStride / 4) + lane]; }
  ZS_HDI uint32_t total(int f) const {
    uint32_t n = 0;
    for (int lane = 0; lane < 32; ++lane) n += share(f, lane);
    return n;
  }

  // Adds the block's table, lanes summed, to the tensor's fields and zeroes
  // it for the next tile; as flush_bins, for tid = 0..kThreads-1.
  ZS_HDI void flush(const LaunchHeader& h, const TensorTiles& t, int tid) const {
    for (int f = tid; f < Binning<T>::kFields; f += kThreads) {
      const uint32_t c = take_lanes(bins + f * static_cast<int>(kStride / 4), f);
      if (c != 0) add_to_field(h, t, f, c);
    }
  }

 private:
  // w's high lane in its low lane (the high lane too), by a multiply by 1 in
  // T's own arithmetic, whose operand swizzle moves the lane on the 16-bit
  // float pipe: one slot where a shift takes two. Exact but for a NaN's
  // payload, and the exponent bits, all that the field reads, stay.
  ZS_HDI static uint32_t high_lane_low(uint32_t w) {
#if defined(__CUDA_ARCH__)
    uint32_t r;
    if constexpr (std::is_same_v<T, bf16_t>) {
      asm("{\n\t.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 t, {h, h};\n\t"
          "fma.rn.bf16x2 %0, t, %2, %3;\n\t}"
          : "=r"(r) : "r"(w), "r"(0x3f803f80u), "r"(0x80008000u));
    } else {
      asm("{\n\t.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %1;\n\tmov.b32 t, {h, h};\n\t"
          "mul.rn.f16x2 %0, t, %2;\n\t}"
          : "=r"(r) : "r"(w), "r"(0x3c003c00u));
    }
    return r;
#else
    return (w >> 16) * 0x10001u;
#endif
  }

  // The table's address is read off its symbol (block_bins), not `bins`:
  // a constant, which the shared-memory instruction adds for free.
  ZS_HDI void at(uint32_t field_offset) const {
#if defined(__CUDA_ARCH__)
    const uint32_t table = static_cast<uint32_t>(__cvta_generic_to_shared(block_bins<LaneBins>()));
    asm volatile("red.shared.add.u32 [%0], %1;" : : "r"(table + (field_offset | lane4)), "r"(weight));
#else
    *reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(bins) + (field_offset | lane4)) += weight;
#endif
  }
};

// Whether a fast-path kernel counts histogram fields (then its FastTally
// leaves at_most_sub and the non-finite count to them: settle_by_fields).
template <typename Fields>
constexpr bool kByFields = !std::is_same_v<Fields, NoFields>;

// One thread's statistics: a Tally (classify.h) that every element goes
// through, the same branch-free classification the CPU uses, and the shift
// its moments are taken about (see set_moments); and, unless Fields is
// NoFields, each element's histogram field counted into `fields`.
//
// The shift is the thread's first finite value, chosen by a select: until a
// finite value has been added it follows every element, and it is set before
// the element is added, so the first finite value adds d = 0 and every later
// one is summed about it. Non-finite values add nothing to the sums (the
// Tally selects them away), whatever the shift was while they went by; a
// thread that sees no finite value reports no moments. The moments are of
// the values times `scale`: 1, or kDownscale where float64 sums overflowed
// (see thread_partial).
template <typename T, typename Fields = NoFields>
struct ThreadStats {
  Tally<T, uint32_t> tally;
  double shift = 0.0;
  double scale = 1.0;
  Fields fields = {};

  ZS_HDI void add(T x, const Limits& lim) {
    if constexpr (!std::is_same_v<Fields, NoFields>) fields.count(x);
    const double v = static_cast<double>(Format<T>::value(x)) * scale;
    shift = tally.finite == 0 ? v : shift;
    tally.add(x, lim, shift, scale);
  }
  ZS_HDI Partial finish() const { return tally.finish(shift); }
};

// A ThreadStats as walk_contiguous's sink: every element added in turn.
template <typename T, typename Fields>
struct TallySink {
  ThreadStats<T, Fields>& st;
  const Limits& lim;

  ZS_HDI void single(T x) { st.add(x, lim); }
  ZS_HDI void vector(const uint4& v, int) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int k = 0; k < kPer; ++k) st.add(element<T>(v, k), lim);
  }
  ZS_HDI void end_group() {}
  ZS_HDI void end_singles() {}
};

// 16-byte loads in flight per thread (a group). Every element is folded in
// as soon as it is extracted, so the loads in flight, not the elements, are
// what occupy registers. float32 takes 8: its fast path's loop instructions
// then cost half as much per element, and its Tally path fits them too
// (cuda_check.sh fails on any spill).
template <typename T>
constexpr int unroll_of() {
  return std::is_same_v<T, float> ? 2 * kUnroll : kUnroll;
}

// Positions [0, n) from p as walk_contiguous splits them: `head` lone
// elements up to the first 16-byte boundary, `nvec` whole vectors, and the
// lone elements from `tail` on.
struct ContiguousSplit {
  int64_t head, nvec, tail;
};

template <typename T>
ZS_HDI ContiguousSplit split_contiguous(const T* p, int64_t n) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  int64_t head = static_cast<int64_t>((16 - (addr & 15)) & 15) / static_cast<int64_t>(sizeof(T));
  head = head < n ? head : n;
  const int64_t nvec = (n - head) / kPer;
  return {head, nvec, head + nvec * kPer};
}

// This thread's share of positions [begin, end) of a contiguous tensor,
// handed to `sink`: 16-byte vectors t, t + kThreads, ..., unroll_of<T>() of
// them in flight (sink.vector(v, u), u the vector's place in its group,
// then sink.end_group()), and the few unaligned elements at either end one
// per thread (sink.single, then sink.end_singles()).
template <typename T, typename Sink>
ZS_HDI void walk_contiguous(const T* data, int64_t begin, int64_t end, int tid, Sink& sink) {
  const T* p = data + begin;
  const int64_t n = end - begin;
  const auto [head, nvec, tail] = split_contiguous(p, n);
  const bool lone_head = tid < head, lone_tail = tid < n - tail;
  if (lone_head) sink.single(load_element(p + tid));
  if (lone_tail) sink.single(load_element(p + tail + tid));
  if (lone_head || lone_tail) sink.end_singles();

  // Vectors tid, tid + kThreads, ... (a tile holds fewer than 2^31: the
  // fast path counts them in 32 bits, which its loop is shorter for; the
  // Tally path's register allocation is the one its 64-bit count gets)
  const uint4* vp = reinterpret_cast<const uint4*>(p + head);
  constexpr int U = unroll_of<T>();
  using Index = std::conditional_t<kHasFastPath<T>, int32_t, int64_t>;
  const Index nv = static_cast<Index>(nvec);
  Index i = tid;
  for (; i + (U - 1) * kThreads < nv; i += U * kThreads) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = load16(vp + i + u * kThreads);
#pragma unroll
    for (int u = 0; u < U; ++u) sink.vector(r[u], u);
    sink.end_group();
  }
  for (; i < nv; i += kThreads) {
    sink.vector(load16(vp + i), 0);
    sink.end_group();
  }
}

// How many elements walk_contiguous hands thread `tid` of positions
// [begin, end) starting at `data`.
template <typename T>
ZS_HDI uint32_t contiguous_share(const T* data, int64_t begin, int64_t end, int tid) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  const int64_t n = end - begin;
  const auto [head, nvec, tail] = split_contiguous(data + begin, n);
  int64_t mine = (tid < head ? 1 : 0) + (tid < n - tail ? 1 : 0);
  if (tid < nvec) mine += (nvec - tid + kThreads - 1) / kThreads * kPer;
  return static_cast<uint32_t>(mine);
}

// ---- The strided walk --------------------------------------------------------

// A strided tile is split into one chunk of consecutive positions per warp;
// lane l of a warp takes positions l, l + 32, l + 64, ... of its chunk, so a
// warp reads 32 neighbouring positions at a time (coalesced where the
// innermost stride is small), and a lane stays in one row of the innermost
// dimension for as long as that row lasts.
constexpr int kWarps = kThreads / 32;

struct LaneSpan {
  int64_t first;  // the lane's first position
  int64_t count;  // how many positions it takes
};

ZS_HDI LaneSpan lane_span(int64_t begin, int64_t end, int tid) {
  const int64_t chunk = ((end - begin + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t chunk_begin = begin + (tid >> 5) * chunk;
  const int64_t chunk_end = chunk_begin + chunk < end ? chunk_begin + chunk : end;
  const int64_t first = chunk_begin + (tid & 31);
  return {first, first < chunk_end ? (chunk_end - first + 31) / 32 : 0};
}

// Position `pos` of a strided layout: its innermost index and outer digits.
template <typename T>
struct StridedCursor {
  const StridedShape& shape;
  const char* data;                // position 0
  int64_t i0;                      // index in the innermost dimension
  int64_t digit[kMaxStridedDims];  // digit[d], d >= 1: index in dimension d
  int64_t step;                    // bytes from a position to the one 32 on, in a row
  const char* at;                  // the element's address

  ZS_HDI StridedCursor(const T* base, const StridedShape& s, int64_t pos)
      : shape(s), data(reinterpret_cast<const char*>(base)) {
    i0 = pos % s.sizes[0];
    int64_t rest = pos / s.sizes[0];
    digit[0] = 0;
#pragma unroll
    for (int d = 1; d < kMaxStridedDims; ++d) {
      digit[d] = rest % s.sizes[d];
      rest /= s.sizes[d];
    }
    step = 32 * s.strides[0] * static_cast<int64_t>(sizeof(T));
    locate();
  }

  // k positions of this lane on (32 k positions of the layout): move, when
  // they stay in the row, then advance, which carries into the next row.
  ZS_HDI void move(int64_t k) {
    i0 += 32 * k;
    at += k * step;
  }
  ZS_HDI void advance(int64_t k) {
    move(k);
    if (i0 >= shape.sizes[0]) next_row();
  }

  // i0 ran past its row: carry whole rows into the outer digits (a row has
  // at least 2 positions, so a step crosses at most 16 of them).
  ZS_HDI void next_row() {
    int64_t carry = 0;
    while (i0 >= shape.sizes[0]) {
      i0 -= shape.sizes[0];
      ++carry;
    }
#pragma unroll
    for (int d = 1; d < kMaxStridedDims; ++d) {  // unrolled: the digits stay in registers
      digit[d] += carry;
      carry = 0;
      while (digit[d] >= shape.sizes[d]) {
        digit[d] -= shape.sizes[d];
        ++carry;
      }
    }
    locate();
  }

 private:
  ZS_HDI void locate() {
    int64_t offset = i0 * shape.strides[0];
#pragma unroll
    for (int d = 1; d < kMaxStridedDims; ++d) offset += digit[d] * shape.strides[d];
    at = data + offset * static_cast<int64_t>(sizeof(T));
  }
};

// Element k of a 16-byte vector of T set to x (the inverse of element<T>).
template <typename T>
ZS_HDI void put_element(uint4& v, int k, T x) {
  if constexpr (sizeof(T) == 4) {
    const uint32_t b = storage_bits(x);
    (k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w) = b;
  } else {
    static_assert(sizeof(T) == 2, "vectors are gathered for the fast path's 4- and 2-byte types");
    const uint32_t b = storage_bits(x);
    uint32_t& w = (k / 2 == 0 ? v.x : k / 2 == 1 ? v.y : k / 2 == 2 ? v.z : v.w);
    w = k % 2 == 0 ? b : (w | (b << 16));
  }
}

// This thread's share of positions [begin, end) of a strided layout (its
// lane's positions of its warp's chunk, lane_span), handed to `sink` as
// walk_contiguous hands a contiguous share: for the fast path's types, groups
// of unroll_of<T>() 16-byte vectors gathered from single loads (sink.vector,
// then sink.end_group); for the others, groups of single elements. A group
// whose elements all lie in one row is loaded at fixed distances from the
// first (one multiply-add an address); a group across rows, and the rest,
// one element at a time (sink.single, a sink.end_singles after every
// vector's worth).
template <typename T, typename Sink>
ZS_HDI void walk_strided(const T* data, const StridedShape& shape, int64_t begin, int64_t end, int tid,
                         Sink& sink) {
  const LaneSpan mine = lane_span(begin, end, tid);
  if (mine.count == 0) return;
  StridedCursor<T> c(data, shape, mine.first);
  constexpr bool kVectors = kHasFastPath<T>;
  constexpr int kPer = kVectors ? 16 / static_cast<int>(sizeof(T)) : 1;
  // Groups of single elements: 32 one-byte loads in flight, 8 of the others.
  constexpr int U = kVectors ? unroll_of<T>() : sizeof(T) == 1 ? 8 * kUnroll : 2 * kUnroll;
  constexpr int G = U * kPer;  // elements of a group
  const int64_t n0 = shape.sizes[0];
  const bool near = c.step * (G - 1) <= static_cast<int64_t>(UINT32_MAX);
  const uint32_t step = static_cast<uint32_t>(c.step);
  int64_t left = mine.count;
  while (left > 0) {
    // Groups that lie in the current row: loads at fixed distances.
    for (; near && left >= G && c.i0 + 32 * (G - 1) < n0; left -= G) {
      T xs[G];
#pragma unroll
      for (int j = 0; j < G; ++j) xs[j] = load_element(reinterpret_cast<const T*>(c.at + static_cast<uint64_t>(step) * j));
      c.move(G);
      if constexpr (kVectors) {
        uint4 r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) put_element<T>(r[u], k, xs[u * kPer + k]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) sink.vector(r[u], u);
      } else {
#pragma unroll
        for (int j = 0; j < G; ++j) sink.single(xs[j]);
      }
      sink.end_group();
    }
    if (c.i0 >= n0) c.next_row();
    // Then a group (or the rest) across rows, one element at a time.
    const int64_t n = left < G ? left : G;
#pragma unroll 1
    for (int64_t j = 0; j < n; ++j) {
      sink.single(load_element(reinterpret_cast<const T*>(c.at)));
      if (j + 1 < left) c.advance(1);
      if ((j + 1) % kPer == 0 || j + 1 == n) sink.end_singles();
    }
    left -= n;
  }
}

struct CombineOp {
  ZS_DEV Partial operator()(Partial a, const Partial& b) const {
    combine(a, b);
    return a;
  }
};

// Reads a partial written by another block of this kernel (through L2),
// word by word: __ldcg has no overload for a struct.
ZS_DEV Partial load_partial(const Partial* p) {
  constexpr int kWords = sizeof(Partial) / 8;
  static_assert(sizeof(Partial) == kWords * 8, "Partial is whole 8-byte words");
  const unsigned long long* w = reinterpret_cast<const unsigned long long*>(p);
  unsigned long long words[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __ldcg(w + i);
  Partial q;
  __builtin_memcpy(&q, words, sizeof(q));  // see bit_cast_to: never a fortified memcpy
  return q;
}

// Launch tile g: its tensor, that tensor's tile count, and the positions.
struct TileSpan {
  int tensor;
  int tiles;
  int64_t begin, end;
};

// The tensor is the last one whose first tile is at most g (block-uniform;
// a few constant-bank reads).
ZS_HDI TileSpan locate(const LaunchHeader& h, const TensorTiles* t, int g) {
  int lo = 0, hi = h.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t[mid].first_tile <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  TileSpan s;
  s.tensor = lo;
  const int next = lo + 1 < h.num_tensors ? t[lo + 1].first_tile : h.num_tiles;
  s.tiles = next - t[lo].first_tile;
  s.begin = static_cast<int64_t>(g - t[lo].first_tile) * t[lo].tile;
  s.end = s.begin + t[lo].tile < t[lo].numel ? s.begin + t[lo].tile
                                              : t[lo].numel;
  return s;
}

// Thread `tid`'s share of launch tile `span` of batch `b`, handed to `sink`.
template <typename T, bool kStrided, typename Batch, typename Sink>
ZS_HDI void walk_share(const Batch& b, const TileSpan& span, int tid, Sink& sink) {
  const T* data = static_cast<const T*>(b.t[span.tensor].data);
  if constexpr (kStrided) {
    walk_strided<T>(data, b.shape[span.tensor], span.begin, span.end, tid, sink);
  } else {
    walk_contiguous<T>(data, span.begin, span.end, tid, sink);
  }
}

// The same, added to `st`.
template <typename T, bool kStrided, typename Batch, typename Fields>
ZS_HDI void scan_share(const Batch& b, const TileSpan& span, int tid,
                       ThreadStats<T, Fields>& st, const Limits& lim) {
  TallySink<T, Fields> sink{st, lim};
  walk_share<T, kStrided>(b, span, tid, sink);
}

// Thread `tid`'s partial of launch tile `span` of batch `b`, its elements
// counted into `fields`. A float64 thread whose sums overflowed (values far
// beyond 1e150, see kDownscale) walks its share once more, the same elements
// in the same order, summing them times kDownscale: a second turn of the
// same loop, so that the rare second walk adds no registers to the scan; it
// counts its elements with weight 0 (`muted`), as the first turn counted
// them. No other type reaches so far.
template <typename T, bool kStrided, typename Batch, typename Fields = NoFields>
ZS_HDI Partial thread_partial(const Batch& b, const TileSpan& span, int tid,
                              const Limits& lim, Fields fields = {}) {
  if constexpr (std::is_same_v<T, double>) {
    double scale = 1.0;
#pragma unroll 1
    for (;;) {
      ThreadStats<T, Fields> st;
      st.scale = scale;
      st.fields = scale == 1.0 ? fields : fields.muted();
      scan_share<T, kStrided>(b, span, tid, st, lim);
      Partial p = st.finish();
      if (scale != 1.0) {
        upscale_moments(p);
        return p;
      }
      if (finite_double(st.tally.s1) && finite_double(st.tally.s2)) return p;
      scale = kDownscale;
    }
  } else {
    ThreadStats<T, Fields> st;
    st.fields = fields;
    scan_share<T, kStrided>(b, span, tid, st, lim);
    return st.finish();
  }
}

// ---- The fast path (fast_tally.cuh) -------------------------------------------

// A FastTally as walk_contiguous's sink, each element's histogram field
// counted into `fields` as ThreadStats does.
template <typename T, typename Fields>
struct FastSink;

template <typename Fields>
struct FastSink<float, Fields> {
  FastTally<float, kByFields<Fields>> tally;
  const FastLimits& k;
  const TileCenter& ctr;
  Fields fields;

  ZS_HDI void single(float x) { single_in(x, 0); }
  // Vectors 2r and 2r + 1 of a group square into run r.
  ZS_HDI void vector(const uint4& v, int u) {
#pragma unroll
    for (int e = 0; e < 4; ++e) single_in(element<float>(v, e), u >> 1);
  }
  ZS_HDI void end_group() { tally.end_group(); }
  ZS_HDI void end_singles() { tally.end_group(); }

 private:
  ZS_HDI void single_in(float x, int run) {
    if constexpr (kByFields<Fields>) fields.count_bits32(bit_cast_to<uint32_t>(x));
    tally.add(x, k, ctr, run);
  }
};

// bfloat16 and float16: a vector is four words of two elements; a lone
// element is a word with a NaN beside it (FastTally16::lone).
template <typename T, typename Fields>
struct FastSink {
  FastTally16<T, kByFields<Fields>> tally;
  const FastLimits& k;
  const TileCenter& ctr;
  Fields fields;
  uint32_t held = 0;      // a single element waiting for a second to share its word
  bool holding = false;
  int lone_lane = 0;      // the lane of the next lone element (they alternate)

  // Elements one at a time are paired into words; one left at end_group
  // goes alone, beside a NaN pad (FastTally16::lone).
  ZS_HDI void single(T x) {
    if constexpr (kByFields<Fields>) fields.count(x);
    if (holding) {
      tally.one_word(held | (static_cast<uint32_t>(x.bits) << 16), k, ctr);
    } else {
      held = x.bits;
    }
    holding = !holding;
  }
  // Vector u of a group squares into run u (8 elements).
  ZS_HDI void vector(const uint4& v, int u) {
    if constexpr (kByFields<Fields>) {
#pragma unroll
      for (int w = 0; w < 4; ++w) fields.count_word16(word(v, w));
    }
#pragma unroll
    for (int w = 0; w < 4; w += 2) {
      tally.word(word(v, w), k, ctr, u, 0);
      tally.word(word(v, w + 1), k, ctr, u, 1);
      tally.extremes();
    }
  }
  ZS_HDI void end_group() { tally.end_group(); }
  ZS_HDI void end_singles() {
    if (holding) {
      tally.lone(static_cast<uint16_t>(held), lone_lane, k, ctr);
      lone_lane ^= 1;
      holding = false;
    }
    tally.end_group();
  }
};

// Thread `tid`'s TileSums of launch tile `span` of batch `b`.
template <typename T, bool kStrided, typename Batch, typename Fields>
ZS_HDI TileSums fast_thread_sums(const Batch& b, const TileSpan& span, int tid,
                                 const TileCenter& ctr, Fields fields) {
  const T* data = static_cast<const T*>(b.t[span.tensor].data);
  FastSink<T, Fields> sink{{}, b.h.fast, ctr, fields};
  walk_share<T, kStrided>(b, span, tid, sink);
  const int64_t mine = kStrided ? lane_span(span.begin, span.end, tid).count
                                : contiguous_share<T>(data, span.begin, span.end, tid);
  return sink.tally.finish(static_cast<uint32_t>(mine));
}

// Where value `lane` of launch tile `span` is, or null past the tile's end.
template <typename T, bool kStrided, typename Batch>
ZS_HDI const T* tile_element(const Batch& b, const TileSpan& span, int lane) {
  const T* data = static_cast<const T*>(b.t[span.tensor].data);
  const int64_t pos = span.begin + lane;
  if (pos >= span.end) return nullptr;
  if constexpr (kStrided) {
    return reinterpret_cast<const T*>(StridedCursor<T>(data, b.shape[span.tensor], pos).at);
  } else {
    return data + pos;
  }
}

// The sample of a tile's center: its first 32 values as floats (value
// `lane` at `at`, null past the tile's end), the finite ones summed in the tree of a warp's
// __shfl_down reduction (lane i takes lane i + o, o = 16, 8, 4, 2, 1), so
// the device (tile_center, one lane each) and the emulation
// (tile_center_serial, a loop) add in the same order.
struct CenterSample {
  float sum, count, largest;
};

template <typename T>
ZS_HDI CenterSample center_sample(const T* at) {
  const float x = at != nullptr ? static_cast<float>(Format<T>::value(load_element(at))) : 0.0f;
  const bool keep = at != nullptr && fabsf(x) < __builtin_huge_valf();
  return {keep ? x : 0.0f, keep ? 1.0f : 0.0f, keep ? fabsf(x) : 0.0f};
}

ZS_HDI CenterSample fold_samples(const CenterSample& a, const CenterSample& b) {
  return {add_rn(a.sum, b.sum), add_rn(a.count, b.count), max_f(a.largest, b.largest)};
}

// tile_center's twin for one thread of execution (standalone_test
// --emulate): the same values added in the same tree.
template <typename T, bool kStrided, typename Batch>
ZS_HDI TileCenter tile_center_serial(const Batch& b, const TileSpan& span) {
  CenterSample lanes[32];
  for (int lane = 0; lane < 32; ++lane) lanes[lane] = center_sample(tile_element<T, kStrided>(b, span, lane));
  for (int o = 16; o > 0; o /= 2) {
    for (int i = 0; i < o; ++i) lanes[i] = fold_samples(lanes[i], lanes[i + o]);
  }
  return make_center(lanes[0].sum, lanes[0].count, lanes[0].largest);
}

// ---- One-byte types: a table of values ------------------------------------------

// A one-byte dtype (float8_e4m3fn, float8_e5m2, bool, uint8, int8) has 256
// values, so a tile is scanned by counting how often each occurs: one shared
// atomic per element, into the block's table, whose row of a value has a
// counter per lane of a warp (no two lanes of a warp ever share a counter or
// a bank). At the end of the tile thread v reads value v's row and makes the
// Partial of value v taken that many times, by the Tally (classify.h's own
// classification, one element) and `repeat`; the block reduction combines
// the 256. Counts and extremes are exact and the moments are those of the
// exact counts, so no tile goes to the Tally walk again.
constexpr int kByteValues = 256;
constexpr int kTableLanes = 32;  // take_lanes reads a row of 32

template <typename T>
constexpr bool kByteTable = sizeof(T) == 1;

// Where value v's counter for `lane` sits in the table, in bytes:
// [kByteValues][kTableLanes] uint32. The byte of a loaded word is shifted
// and masked into place (one SHF, one LOP3 that also adds the lane); a byte
// loaded alone takes one IMAD, which the compiler would split in two.
ZS_HDI uint32_t table_offset(uint32_t v, uint32_t lane4) { return (v << 7) | lane4; }
ZS_HDI uint32_t table_offset_of_byte(uint32_t v, uint32_t lane4) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mad.lo.u32 %0, %1, 128, %2;" : "=r"(r) : "r"(v), "r"(lane4));
  return r;
#else
  return table_offset(v, lane4);
#endif
}

// walk_contiguous's and walk_strided's sink: each element's value counted.
template <typename T>
struct ByteSink {
  uint32_t* table;  // [kByteValues * kTableLanes]
  uint32_t lane4;   // the thread's lane times 4

  ZS_HDI void single(T x) { bump(table_offset_of_byte(storage_bits(x), lane4)); }
  ZS_HDI void vector(const uint4& v, int) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t bits = word(v, w);
#pragma unroll
      for (int k = 0; k < 4; ++k) bump(table_offset((bits >> (8 * k)) & 0xffu, lane4));
    }
  }
  ZS_HDI void end_group() {}
  ZS_HDI void end_singles() {}

 private:
  // One more at byte `offset` of the table.
  ZS_HDI void bump(uint32_t offset) const {
    uint32_t* c = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(table) + offset);
#if defined(__CUDA_ARCH__)
    atomicAdd(c, 1u);
#else
    *c += 1u;
#endif
  }
};

// The Partial of value v's count in `table` (read and zeroed for the next
// tile), each of those elements' histogram fields counted into `fields`.
template <typename T, typename Fields>
ZS_HDI Partial value_partial(uint32_t* table, int v, const Limits& lim, const Fields& fields) {
  const uint32_t n = take_lanes(table + v * kTableLanes, v);
  if (n == 0) return empty_partial();
  const T x = storage_of_bits<T>(static_cast<uint8_t>(v));
  fields.count_n(x, n);
  Tally<T, uint32_t> one;
  const double value = static_cast<double>(Format<T>::value(x));
  one.add(x, lim, value);
  Partial p = one.finish(value);
  repeat(p, n);
  return p;
}

// The counts of TileSums, in the order block_sums reduces them: zeros,
// at_most_sub, at_most[] (classify.h's bounds), finite, non_nan, negative,
// neginf.
constexpr int kTileCounts = 6 + kNumBounds;

// The block's TileSums, in thread 0: each warp's counts and key extremes in
// one REDUX each (a count c < 2^23 enters as the bits of c + 2^23, whose sum
// over 32 lanes is 32 * 0x4b000000 + sum c modulo 2^32), its sums of moments
// in a __shfl_down tree, and the warps in order by thread 0: a fixed order,
// so the result does not depend on timing.
struct WarpSums {
  uint32_t counts[kTileCounts];
  uint32_t lo, hi;
  double s1, s2;
};

ZS_DEV uint32_t warp_count(float c) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(0xffffffffu, __float_as_uint(add_rn(c, 0x1p23f))) - 0x60000000u;
#else
  return 0;  // unreachable: kHasFastPath is false below sm_80
#endif
}

ZS_DEV TileSums block_sums(const TileSums& s, WarpSums (&warps)[kThreads / 32]) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  float counts[kTileCounts] = {s.zeros, s.at_most_sub};
#pragma unroll
  for (int b = 0; b < kNumBounds; ++b) counts[2 + b] = s.at_most[b];
  counts[2 + kNumBounds] = s.finite;
  counts[3 + kNumBounds] = s.non_nan;
  counts[4 + kNumBounds] = s.negative;
  counts[5 + kNumBounds] = s.neginf;
  WarpSums w;
#pragma unroll
  for (int k = 0; k < kTileCounts; ++k) w.counts[k] = warp_count(counts[k]);
#if __CUDA_ARCH__ >= 800
  w.lo = __reduce_min_sync(0xffffffffu, s.lo);
  w.hi = __reduce_max_sync(0xffffffffu, s.hi);
#endif
  w.s1 = s.s1;
  w.s2 = s.s2;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    w.s1 += __shfl_down_sync(0xffffffffu, w.s1, o);
    w.s2 += __shfl_down_sync(0xffffffffu, w.s2, o);
  }
  if (lane == 0) warps[warp] = w;
  __syncthreads();
  TileSums out;
  if (threadIdx.x == 0) {
    uint32_t total[kTileCounts] = {};
    for (int k = 0; k < kThreads / 32; ++k) {
      const WarpSums& v = warps[k];
      for (int c = 0; c < kTileCounts; ++c) total[c] += v.counts[c];
      out.lo = v.lo < out.lo ? v.lo : out.lo;
      out.hi = v.hi > out.hi ? v.hi : out.hi;
      out.s1 += v.s1;
      out.s2 += v.s2;
    }
    out.zeros = static_cast<float>(total[0]);
    out.at_most_sub = static_cast<float>(total[1]);
    for (int b = 0; b < kNumBounds; ++b) out.at_most[b] = static_cast<float>(total[2 + b]);
    out.finite = static_cast<float>(total[2 + kNumBounds]);
    out.non_nan = static_cast<float>(total[3 + kNumBounds]);
    out.negative = static_cast<float>(total[4 + kNumBounds]);
    out.neginf = static_cast<float>(total[5 + kNumBounds]);
  }
  return out;
}

// Thread 0's `sums` (from block_sums: every thread has counted its fields)
// completed from the block's histogram table: warp 0 adds the lanes' shares
// of field 0 and of the top field.
template <typename T, typename Fields>
ZS_DEV void settle_from_table(TileSums& sums, const Fields& fields, int64_t positions, int tid) {
#if __CUDA_ARCH__ >= 800
  if (tid < 32) {
    const uint32_t low = __reduce_add_sync(0xffffffffu, fields.share(0, tid));
    const uint32_t top = __reduce_add_sync(0xffffffffu, fields.share(Binning<T>::kFields - 1, tid));
    if (tid == 0) {
      settle_by_fields<T>(sums, static_cast<float>(low), static_cast<float>(top), static_cast<float>(positions));
    }
  }
#endif  // below sm_80 there is no fast path
}

// Lane 0 of the calling warp gets the center of launch tile `span`.
template <typename T, bool kStrided, typename Batch>
ZS_DEV TileCenter tile_center(const Batch& b, const TileSpan& span) {
  CenterSample s = center_sample(tile_element<T, kStrided>(b, span, static_cast<int>(threadIdx.x & 31)));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const CenterSample other = {__shfl_down_sync(0xffffffffu, s.sum, o), __shfl_down_sync(0xffffffffu, s.count, o),
                                __shfl_down_sync(0xffffffffu, s.largest, o)};
    s = fold_samples(s, other);
  }
  return make_center(s.sum, s.count, s.largest);
}

// A block's histogram table: Bins::kWords uint32 counters in shared memory
// (FieldBins: float64's 2048 fields take 8 KiB; LaneBins: 32 KiB). Declared
// here rather than in the kernel so that the kernels without kHist do not
// allocate it.
template <typename Bins>
__device__ uint32_t* block_bins() {
  __shared__ uint32_t bins[Bins::kWords];
  return bins;
}

// Adds the block's table (`bins`, as counted for a tile of tensor `t`) to
// the tensor's fields, row t.row of h.hist, times the tensor's repeat, and
// zeroes the table for the next tile. On the device every thread of the
// block calls it, once all of them have counted; other blocks add to the
// same fields, hence the atomics (integer: their order changes nothing).
// standalone_test --emulate calls it on the host for tid = 0..kThreads-1.
template <typename T>
ZS_HDI void flush_bins(const LaunchHeader& h, const TensorTiles& t, uint32_t* bins, int tid) {
  for (int f = tid; f < Binning<T>::kFields; f += kThreads) {
    const uint32_t c = bins[f];
    if (c != 0) {
      add_to_field(h, t, f, c);
      bins[f] = 0;
    }
  }
}

// Launch tile `span`'s Partial (in thread 0) by the fast path when the
// launch has it on, else, or when its moments fall short (fast_partial), by
// the Tally path, whose walk then counts no histogram field again.
template <typename T, bool kStrided, typename Batch, typename Fields, typename Temp>
ZS_DEV Partial fast_tile_partial(const Batch& b, const TileSpan& span, int tid, const Limits& lim,
                                 const Fields& fields, Temp& temp, TileCenter& center, bool& again) {
  using Reduce = cub::BlockReduce<Partial, kThreads>;
  Partial p;
  bool walked = false;  // block-uniform
  if (b.h.fast.on) {
    if (tid < 32) {
      const TileCenter c = tile_center<T, kStrided>(b, span);
      if (tid == 0) center = c;
    }
    __syncthreads();
    const TileCenter ctr = center;
    if (fast_center_ok<T>(ctr)) {
      TileSums sums = block_sums(fast_thread_sums<T, kStrided>(b, span, tid, ctr, fields), temp.warps);
      if constexpr (kByFields<Fields>) settle_from_table<T>(sums, fields, span.end - span.begin, tid);
      if (tid == 0) again = !fast_partial<T>(sums, ctr, span.end - span.begin, p);
      __syncthreads();  // `again` is read, `temp` is free
      if (!again) return p;
      walked = true;
    }
  }
  const Fields counted = walked ? fields.muted() : fields;
  return Reduce(temp.partial).Reduce(thread_partial<T, kStrided>(b, span, tid, lim, counted), CombineOp());
}

// The one-byte types' table: [kByteValues][kTableLanes] uint32 (32 KiB) in
// shared memory, zero between tiles. Declared here rather than in the kernel
// so that only their kernels allocate it.
ZS_DEV uint32_t* value_table() {
  __shared__ uint32_t table[kByteValues * kTableLanes];
  return table;
}

// Launch tile `span`'s Partial (in thread 0) from the counts of its values.
template <typename T, bool kStrided, typename Batch, typename Fields, typename Temp>
ZS_DEV Partial table_tile_partial(const Batch& b, const TileSpan& span, int tid, const Limits& lim,
                                  const Fields& fields, Temp& temp) {
  static_assert(kThreads == kByteValues, "one thread per value");
  using Reduce = cub::BlockReduce<Partial, kThreads>;
  uint32_t* table = value_table();
  ByteSink<T> sink{table, static_cast<uint32_t>(tid & 31) * 4u};
  walk_share<T, kStrided>(b, span, tid, sink);
  __syncthreads();  // every element is counted
  return Reduce(temp.partial).Reduce(value_partial<T>(table, tid, lim, fields), CombineOp());
}

// Grid-stride loop over the launch's tiles. See the file comment. kHist:
// count every element's histogram field too (h.hist is then not null).
// Contiguous float32, bfloat16 and float16 tiles take the fast path
// (fast_tally.cuh) when the launch's h.fast.on; a tile whose fast moments
// fall short (fast_partial) is walked again by the Tally path, its
// histogram fields muted (the fast walk counted them).
template <typename T, bool kStrided, bool kHist, typename Batch>
__device__ __forceinline__ void scan_tiles(const Batch& b) {
  using Reduce = cub::BlockReduce<Partial, kThreads>;
  constexpr bool kFast = kHasFastPath<T>;
  using Bins = std::conditional_t<kFast, LaneBins<T>, FieldBins<T>>;
  using Fields = std::conditional_t<kHist, Bins, NoFields>;
  __shared__ union {
    typename Reduce::TempStorage partial;
    WarpSums warps[kThreads / 32];
  } temp;
  __shared__ bool last_tile_done;
  __shared__ TileCenter center;
  __shared__ bool again;

  const LaunchHeader& h = b.h;
  const Limits lim = h.limits;

  const int tid = static_cast<int>(threadIdx.x);
  Fields fields = {};
  if constexpr (kHist) {
    fields = Bins::make(block_bins<Bins>(), tid);
    for (int i = tid; i < Bins::kWords; i += kThreads) fields.bins[i] = 0;
  }
  if constexpr (kByteTable<T>) {
    uint32_t* table = value_table();
    for (int i = tid; i < kByteValues * kTableLanes; i += kThreads) table[i] = 0;
  }
  __syncthreads();  // zeroed before any thread counts
  for (int g = blockIdx.x; g < h.num_tiles; g += gridDim.x) {
    const TileSpan span = locate(h, b.t, g);
    const TensorTiles& t = b.t[span.tensor];
    const int tiles = span.tiles;

    Partial p;
    if constexpr (kByteTable<T>) {
      p = table_tile_partial<T, kStrided>(b, span, tid, lim, fields, temp);
    } else if constexpr (kFast) {
      p = fast_tile_partial<T, kStrided>(b, span, tid, lim, fields, temp, center, again);
    } else {
      p = Reduce(temp.partial).Reduce(thread_partial<T, kStrided>(b, span, tid, lim, fields),
                                      CombineOp());
    }
    if constexpr (kHist) {
      __syncthreads();  // every thread's counts are in the table
      fields.flush(h, t, tid);
      // The __syncthreads closing this iteration keeps the next tile's
      // counts from reaching the table before it is zeroed.
    }
    int64_t* row = h.out + static_cast<int64_t>(t.row) * kNumFields;

    if (tiles == 1) {
      if (tid == 0) {
        repeat(p, t.repeat);
        store(p, row);
      }
    } else {
      Partial* slots = h.partials + h.slot_base + t.first_tile;
      if (tid == 0) {
        slots[g - t.first_tile] = p;
        __threadfence();  // the partial is visible before the count is
        const int done = atomicAdd(h.counters + t.row, 1);
        last_tile_done = done == tiles - 1;
      }
      __syncthreads();
      if (last_tile_done) {
        __threadfence();
        Partial q = empty_partial();
        for (int k = tid; k < tiles; k += kThreads) {
          combine(q, load_partial(slots + k));
        }
        q = Reduce(temp.partial).Reduce(q, CombineOp());
        if (tid == 0) {
          repeat(q, t.repeat);
          store(q, row);
        }
      }
    }
    __syncthreads();  // `temp`, `last_tile_done` (and the table) are reused
  }
}

// The fast path's kernels ask for two blocks per SM (at most 128 registers
// a thread): its accumulators and eight 16-byte loads in flight fit without
// spilling. The Tally path's, and the histogram's (whose shared-memory
// counts add to the registers), are left to ptxas (0: no minimum).
template <typename T, bool kHist>
constexpr int kContigMinBlocksPerSm = kHasFastPath<T> && !kHist ? 2 : 0;

template <typename T, bool kHist>
__global__ void __launch_bounds__(kThreads, kContigMinBlocksPerSm<T, kHist>)
    scan_contig_kernel(const __grid_constant__ ContigBatch b) {
  scan_tiles<T, false, kHist>(b);
}

// The strided walker keeps four int64 digits per dimension live next to the
// Tally. Left to itself, ptxas squeezes the narrow types' strided kernels
// into 80 registers (three blocks per SM) and spills; asking for two blocks
// per SM (at most 128 registers) is the occupancy they had before and keeps
// every kernel free of spills.
constexpr int kStridedMinBlocksPerSm = 2;

template <typename T, bool kHist>
__global__ void __launch_bounds__(kThreads, kStridedMinBlocksPerSm)
    scan_strided_kernel(const __grid_constant__ StridedBatch b) {
  scan_tiles<T, true, kHist>(b);
}

template <typename T>
void launch_contig(const ContigBatch& batch, int grid, cudaStream_t stream) {
  if (batch.h.hist != nullptr) {
    scan_contig_kernel<T, true><<<grid, kThreads, 0, stream>>>(batch);
  } else {
    scan_contig_kernel<T, false><<<grid, kThreads, 0, stream>>>(batch);
  }
}

template <typename T>
void launch_strided(const StridedBatch& batch, int grid, cudaStream_t stream) {
  if (batch.h.hist != nullptr) {
    scan_strided_kernel<T, true><<<grid, kThreads, 0, stream>>>(batch);
  } else {
    scan_strided_kernel<T, false><<<grid, kThreads, 0, stream>>>(batch);
  }
}

}  // namespace cuda
}  // namespace zeroscan

// For the per-dtype files: the two launchers of one storage type (each
// instantiates its kernel with and without kHist).
#define ZEROSCAN_INSTANTIATE_CUDA(T)                                      \
  template void zeroscan::cuda::launch_contig<T>(                        \
      const zeroscan::cuda::ContigBatch&, int, cudaStream_t);            \
  template void zeroscan::cuda::launch_strided<T>(                       \
      const zeroscan::cuda::StridedBatch&, int, cudaStream_t)

#endif  // defined(__CUDACC__)
