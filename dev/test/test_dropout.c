/* The dropout generator alone (llmc/core/dropout.h): Philox4x32-10 against the
 * Random123 known-answer vectors, the attention draw layout as a bijection
 * onto (group, draw) that gives each mma.sync lane its own calls, and the
 * dropped fraction against the threshold's exact probability. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../../llmc/core/dropout.h"

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { printf("FAIL line %d: %s\n", __LINE__, #cond); failures++; } } while (0)

/* philox4x32 10 lines of Random123's kat_vectors: counter, key, expected. */
static void check_known_answers(void) {
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        philox4x32_10(kat[i], kat[i] + 4, out);
        CHECK(memcmp(out, kat[i] + 6, sizeof(out)) == 0);
    }
}

/* Every (t,u) of a head maps to a distinct (group, draw); the eight elements
 * one lane holds of a 16x16 block (rows r, r+8; columns 2c, 2c+1, 8+2c, 9+2c)
 * share one group, and distinct lanes or blocks never share one. */
static void check_attention_layout(int T) {
    int nb = (T + 15) / 16;
    size_t slots = (size_t)2 * nb * nb * 32 * 8;
    unsigned char* seen = calloc(slots, 1);
    for (int bh = 0; bh < 2; bh++)
        for (int t = 0; t < T; t++)
            for (int u = 0; u < T; u++) {
                uint64_t g = dropout_attention_group(bh, T, t, u);
                int d = dropout_attention_draw(t, u);
                CHECK(d >= 0 && d < 8 && g * 8 + (uint64_t)d < slots);
                if (g * 8 + (uint64_t)d >= slots) continue;
                CHECK(!seen[g * 8 + d]);
                seen[g * 8 + d] = 1;
                int lane_row = t % 8, lane_col = (u % 8) / 2, r0 = t / 16 * 16, c0 = u / 16 * 16;
                for (int dr = 0; dr < 16; dr += 8)
                    for (int dc = 0; dc < 16; dc += 8)
                        for (int odd = 0; odd < 2; odd++)
                            CHECK(dropout_attention_group(bh, T, r0 + lane_row + dr, c0 + 2 * lane_col + dc + odd) == g);
            }
    free(seen);
}

/* The dropped fraction of n draws within 5 standard errors of threshold/65536. */
static void check_fraction(float p, DropoutSiteKind kind) {
    DropoutState st = {{0}, 1234, 1, 7, 2, 0, 0};
    st.p[kind] = p;
    DropoutSite s = dropout_site(&st, kind, 3);
    const int n = 1 << 20;
    int dropped = 0;
    for (int e = 0; e < n; e++) dropped += !dropout_keep_flat(&s, (uint64_t)e);
    double q = s.threshold / 65536.0, se = sqrt(q * (1 - q) / n);
    CHECK(fabs((double)dropped / n - q) <= 5 * se + 1e-12);
    CHECK(fabs(q - p) <= 0.5 / 65536);
    CHECK(s.scale * (1.0 - q) > 1.0 - 1e-6 && s.scale * (1.0 - q) < 1.0 + 1e-6);
}

/* Different keys and counters give different masks; p = 0 keeps everything. */
static void check_independence(void) {
    DropoutState a = {{0.5f, 0.5f, 0.5f, 0.5f}, 1, 0, 3, 0, 0, 0};
    DropoutState b[4] = {a, a, a, a};
    b[0].seed = 2;
    b[1].step = 5;
    b[2].step = 4;
    b[3].micro_step = 1;
    DropoutSite sa = dropout_site(&a, DROPOUT_RESID_MLP, 5);
    for (int i = 0; i < 5; i++) {
        DropoutSite sb = i < 4 ? dropout_site(&b[i], DROPOUT_RESID_MLP, 5) : dropout_site(&a, DROPOUT_RESID_MLP, 6);
        int same = 0;
        for (int e = 0; e < 4096; e++) same += dropout_keep_flat(&sa, (uint64_t)e) == dropout_keep_flat(&sb, (uint64_t)e);
        CHECK(same > 1800 && same < 2300); /* half agree by chance: 2048 +- 32 */
    }
    DropoutState off = {{0}, 1, 0, 3, 0, 0, 0};
    DropoutSite s = dropout_site(&off, DROPOUT_ATTENTION, 0);
    CHECK(s.threshold == 0 && s.scale == 1.0f && !dropout_active(&off));
    for (int e = 0; e < 4096; e++) CHECK(dropout_keep_attention(&s, 0, 64, e / 64, e % 64));
}

/* Masks are keyed by the global sequence, not the rank: the rank whose
 * first sequence is f draws, for its sequence j, what a rank holding the
 * batch from sequence 0 draws for sequence f + j; two sequences differ. */
static void check_sequence_keying(void) {
    const int T = 40, NH = 3, C = 24;
    DropoutState whole = {{0.5f, 0.5f, 0.5f, 0.5f}, 9, 0, 3, 1, T, NH}, later = whole;
    later.first_sequence = 5;
    DropoutSite a0 = dropout_site(&whole, DROPOUT_ATTENTION, 2), a5 = dropout_site(&later, DROPOUT_ATTENTION, 2);
    int differ = 0;
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < T; t++)
            for (int u = 0; u <= t; u++) {
                CHECK(dropout_keep_attention(&a5, h, T, t, u) == dropout_keep_attention(&a0, 5 * NH + h, T, t, u));
                differ += dropout_keep_attention(&a0, h, T, t, u) != dropout_keep_attention(&a5, h, T, t, u);
            }
    CHECK(differ > NH * T * (T + 1) / 2 / 4); /* about half */
    DropoutSite r0 = dropout_site(&whole, DROPOUT_RESID_MLP, 2), r5 = dropout_site(&later, DROPOUT_RESID_MLP, 2);
    CHECK(r0.row0 == 0 && r5.row0 == 5 * (uint64_t)T && r5.group0 == 0 && a0.group0 == 0);
    differ = 0;
    for (uint64_t e = 0; e < (uint64_t)T * C; e++) differ += dropout_keep_flat(&r0, e) != dropout_keep_flat(&r5, r5.row0 * C + e);
    CHECK(differ > T * C / 4);
}

int main(void) {
    check_known_answers();
    check_attention_layout(16);
    check_attention_layout(45);
    check_fraction(0.1f, DROPOUT_ATTENTION);
    check_fraction(0.5f, DROPOUT_EMBEDDING);
    check_fraction(0.9f, DROPOUT_RESID_ATTN);
    check_independence();
    check_sequence_keying();
    printf("%s: dropout generator (%d failures)\n", failures ? "FAIL" : "PASS", failures);
    return failures != 0;
}
