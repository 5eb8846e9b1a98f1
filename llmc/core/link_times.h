/*
 * Transfers timed on one link (host <-> device copies, the ring's sends), and
 * the line through them: the cost model's measured bandwidth and latency
 * (plan/cost_model.h). Here, not in the cost model, because the copies that
 * are timed live in the backends (cpu/, cuda/), which do not include the planner.
 */
#ifndef REMAT_LINK_TIMES_H
#define REMAT_LINK_TIMES_H

/* Transfers a trainer timed on one link: sums for link_fit. */
typedef struct { double count, bytes, seconds, bytes_sq, bytes_seconds; } LinkTimes;

static inline void link_times_add(LinkTimes* t, double bytes, double seconds) {
    t->count += 1.0;
    t->bytes += bytes;
    t->seconds += seconds;
    t->bytes_sq += bytes * bytes;
    t->bytes_seconds += bytes * seconds;
}

/* The least-squares line t = latency + bytes / bandwidth through the timed
 * transfers; returns 0. When they do not tell latency from bandwidth (one
 * size, or a fit with a negative latency or no positive slope), the latency
 * is `assumed_latency_s`, at most half the mean transfer's time, and the
 * bandwidth the bytes over the time the latencies leave; returns 1. Returns
 * -1 with nothing timed. */
static inline int link_fit(const LinkTimes* t, double assumed_latency_s, double* bytes_per_s, double* latency_s) {
    if (!(t->count > 0) || !(t->bytes > 0) || !(t->seconds > 0)) return -1;
    double spread = t->count * t->bytes_sq - t->bytes * t->bytes;
    if (spread > 1e-9 * t->count * t->bytes_sq) {
        double slope = (t->count * t->bytes_seconds - t->bytes * t->seconds) / spread;
        double lat = (t->seconds - slope * t->bytes) / t->count;
        if (slope > 0 && lat >= 0) { *bytes_per_s = 1.0 / slope; *latency_s = lat; return 0; }
    }
    double lat = assumed_latency_s;
    if (t->seconds - t->count * lat <= 0.5 * t->seconds) lat = 0.5 * t->seconds / t->count;
    *latency_s = lat;
    *bytes_per_s = t->bytes / (t->seconds - t->count * lat);
    return 1;
}

#endif
