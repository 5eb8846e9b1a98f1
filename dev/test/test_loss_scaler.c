/* The FP16 loss scaler's state machine (llmc/run/loss_scaler.h) and its
 * round trip through a checkpoint's state header, on the CPU. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "../../llmc/run/loss_scaler.h"
#include "../../llmc/core/checkpoint.h"

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
    /* a state restored from a checkpoint continues exactly as the original:
     * a fresh scaler plus the two fields the state file keeps (as trainer.h
     * restores it) is the whole state, and the header keeps them bit for bit */
    LossScaler a, b;
    loss_scaler_init(&a, 1);
    for (int i = 0; i < 1234; i++) loss_scaler_update(&a, i % 500 != 7);
    CHECK(a.scale != 65536.0f && a.clean_steps != 0); /* a state no fresh scaler has */
    char path[] = "/tmp/remat_test_loss_scaler_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    TrainState saved, restored;
    memset(&saved, 0, sizeof(saved));
    saved.world = 1; saved.B = 1; saved.T = 1; saved.num_params = 1; /* a header state_open accepts */
    saved.loss_scale = a.scale;
    saved.clean_steps = a.clean_steps;
    FILE* f = fopen_check(path, "wb");
    state_header_write(f, &saved, path);
    fclose_check(f, path);
    fclose(state_open(path, &restored));
    remove(path);
    loss_scaler_init(&b, 1);
    b.scale = restored.loss_scale;
    b.clean_steps = restored.clean_steps;
    CHECK(memcmp(&a, &b, sizeof(a)) == 0);
    /* clean steps first, so the growth point depends on the restored count */
    int growths = 0;
    for (int i = 0; i < 5000; i++) {
        int finite = i < 2500 || (i * 7919) % 1777 != 3;
        float before = a.scale;
        CHECK(loss_scaler_update(&a, finite) == loss_scaler_update(&b, finite));
        CHECK(a.scale == b.scale && a.clean_steps == b.clean_steps);
        growths += a.scale > before;
    }
    CHECK(growths > 0);
    printf("%s: loss scaler, %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
