/* The FP16 loss scaler's state machine (llmc/loss_scaler.h), on the CPU. */
#include <stdio.h>
#include "../../llmc/loss_scaler.h"

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { printf("FAIL line %d: %s\n", __LINE__, #cond); failures++; } } while (0)

int main(void) {
    LossScaler s;
    loss_scaler_init(&s, 0);
    CHECK(loss_scaler_factor(&s) == 1.0f);
    CHECK(loss_scaler_update(&s, 0) == 1); /* disabled: never skips, never changes */
    CHECK(s.scale == 1.0f);

    loss_scaler_init(&s, 1);
    CHECK(loss_scaler_factor(&s) == 65536.0f);
    /* overflow: skip and halve, clean count restarts */
    for (int i = 0; i < 5; i++) CHECK(loss_scaler_update(&s, 1) == 1);
    CHECK(s.clean_steps == 5);
    CHECK(loss_scaler_update(&s, 0) == 0);
    CHECK(s.scale == 32768.0f && s.clean_steps == 0);
    /* growth after exactly growth_interval clean steps, not before */
    for (int i = 0; i < s.growth_interval - 1; i++) loss_scaler_update(&s, 1);
    CHECK(s.scale == 32768.0f);
    CHECK(loss_scaler_update(&s, 1) == 1);
    CHECK(s.scale == 65536.0f && s.clean_steps == 0);
    /* repeated overflow bottoms out at the minimum */
    for (int i = 0; i < 40; i++) CHECK(loss_scaler_update(&s, 0) == 0);
    CHECK(s.scale == s.min_scale);
    /* growth stops at the maximum */
    s.scale = s.max_scale;
    for (int i = 0; i < s.growth_interval; i++) loss_scaler_update(&s, 1);
    CHECK(s.scale == s.max_scale);
    /* a restored state continues exactly as the original */
    LossScaler a, b;
    loss_scaler_init(&a, 1);
    for (int i = 0; i < 1234; i++) loss_scaler_update(&a, i % 500 != 7);
    b = a;
    for (int i = 0; i < 5000; i++) {
        int finite = (i * 7919) % 1777 != 3;
        CHECK(loss_scaler_update(&a, finite) == loss_scaler_update(&b, finite));
    }
    CHECK(a.scale == b.scale && a.clean_steps == b.clean_steps);
    printf("%s: loss scaler, %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
