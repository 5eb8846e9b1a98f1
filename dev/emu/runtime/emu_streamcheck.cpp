/*
 * emu_streamcheck.cpp: hazards between streams for remat's CPU emulator of
 * CUDA (dev/emu; not a GPU).
 *
 * Why it exists: work on two streams (the trainer's compute stream and its
 * NCCL stream; copy streams later) is ordered only by events, stream waits
 * and host synchronisation. A missing cudaStreamWaitEvent gives a GPU a race
 * that shows only under some timings; here it stops the run at the first
 * access that nothing orders, whatever order the streams ran in.
 *
 * How: every operation a stream runs (kernel, copy, memset, matmul, NCCL
 * call) gets an id and an epoch (the count of operations its stream has run,
 * this one included); each stream carries a vector clock (emu_runtime.cpp:
 * for every stream, the latest epoch of it that this stream is ordered
 * after, through event waits, the legacy default stream's implicit waits and
 * the host's synchronisations). Per device byte a shadow holds the ids of the
 * last operation that wrote it and of the last that read it. An access by
 * operation X on stream t to a byte last written (or, for a write, last
 * read) by operation Y on stream s != t is ordered iff t's clock has reached
 * Y's epoch for s; otherwise the program stops naming the buffer, both
 * operations and both streams.
 *
 * The shadow: 8 bytes per device byte (writer id, reader id), at
 * a + 2 * g_dev_len + 8 * (a - g_dev_lo) inside the range emu_initcheck.cpp
 * reserves; pages exist only where touched. It is consulted only once a
 * second stream exists (g_stream_check): a program on one stream pays
 * nothing. Limits: one reader per byte is kept (the latest), so of two
 * unordered readers on different streams followed by a write ordered after
 * only the second, the first is not seen.
 */
#include <string.h>

#include <string>
#include <vector>

#include "emu_internal.h"

namespace emu {

bool g_stream_check = false;

namespace {

struct OpRecord {
    int stream;
    uint32_t epoch;
    std::string what;
};

struct Access {
    uint32_t w, r; /* op ids (index into g_ops), 0 for none */
};

std::vector<OpRecord> g_ops(1); /* id 0: nothing */
uint32_t g_op = 0;              /* the running operation, 0 outside */
int g_op_stream = -1;
const std::vector<uint32_t>* g_op_clock = nullptr;

inline Access* shadow(uintptr_t a) { return (Access*)stream_shadow_at(a); }

bool ordered(uint32_t prev) {
    const OpRecord& p = g_ops[prev];
    if (p.stream == g_op_stream) return true;
    return (size_t)p.stream < g_op_clock->size() && (*g_op_clock)[p.stream] >= p.epoch;
}

[[noreturn]] void hazard(uintptr_t a, bool write, uint32_t prev, bool prev_wrote) {
    const OpRecord& p = g_ops[prev];
    const OpRecord& me = g_ops[g_op];
    std::string where = describe_device_byte(a);
    fatal("stream hazard: %s on %s %s %s, which %s on %s %s before, and no event wait, stream wait or host synchronisation "
          "orders the two (a GPU may run them in either order, or at once)",
          me.what.c_str(), stream_name(me.stream).c_str(), write ? "writes" : "reads", where.c_str(), p.what.c_str(),
          stream_name(p.stream).c_str(), prev_wrote ? "wrote" : "read");
}

}  // namespace

uint32_t stream_op_begin(int stream, uint32_t epoch, const std::vector<uint32_t>* clock, std::string what) {
    uint32_t id = 0;
    if (g_stream_check) {
        id = (uint32_t)g_ops.size();
        if (id == UINT32_MAX) fatal("streamcheck: more than 4 billion operations");
        g_ops.push_back(OpRecord{stream, epoch, std::move(what)});
    }
    stream_op_resume(id, stream, clock);
    return id;
}

void stream_op_resume(uint32_t id, int stream, const std::vector<uint32_t>* clock) {
    g_op = id;
    g_op_stream = stream;
    g_op_clock = clock;
}

void stream_op_end(void) {
    g_op = 0;
    g_op_stream = -1;
    g_op_clock = nullptr;
}

void stream_access(const void* p, size_t n, bool write) {
    uintptr_t a = (uintptr_t)p;
    if (!g_stream_check || !g_op || !n || !is_device_address(a)) return;
    Access* s = shadow(a);
    for (size_t i = 0; i < n; i++) {
        Access& x = s[i];
        if (x.w && x.w != g_op && !ordered(x.w)) hazard(a + i, write, x.w, true);
        if (write) {
            if (x.r && x.r != g_op && !ordered(x.r)) hazard(a + i, write, x.r, false);
            x.w = g_op;
            x.r = 0;
        } else {
            x.r = g_op;
        }
    }
}

}  // namespace emu
