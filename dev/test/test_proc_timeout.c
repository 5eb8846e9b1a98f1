/*
 * llmc/core/multiproc.h's --collective-timeout on its own, under mpirun, with
 * collectives that ranks skip or diverge on by construction (the trainers
 * never do): run by dev/test/test_multiprocess.py. Every rank sets a 1 s
 * timeout and meets at "the first sum" of step 4; then, by mode:
 *   missing  ranks other than 0 never reach "the second sum"
 *   inside   the last rank arrives at "the second sum" but never posts its part
 *   diverge  rank 1 enters "a barrier" while the others enter "a sum"
 *   steps    rank 1 counts step 5 while the others count step 4, all in "a sum"
 * Ranks that leave the script sleep until the job is stopped.
 */
#include "llmc/core/multiproc.h"

static void sleep_until_stopped(void) {
    for (;;) sleep(1);
}

int main(int argc, char** argv) {
    proc_init(&argc, &argv);
    if (argc != 2) fail("usage: test_proc_timeout missing|inside|diverge|steps");
    const char* mode = argv[1];
    int rank = remat_proc.rank, world = remat_proc.world;
    proc_set_collective_timeout(1);
    proc_set_step(4);
    if (proc_sum(1.0, "the first sum") != world) fail("the first sum is wrong");
    if (strcmp(mode, "missing") == 0) {
        if (rank != 0) sleep_until_stopped();
        proc_sum(1.0, "the second sum");
    } else if (strcmp(mode, "inside") == 0) {
        if (rank == world - 1) {
            proc_collective_begin("the second sum");
            sleep_until_stopped();
        }
        proc_sum(1.0, "the second sum");
    } else if (strcmp(mode, "diverge") == 0) {
        if (rank == 1) proc_barrier("a barrier");
        else proc_sum(1.0, "a sum");
        sleep_until_stopped();
    } else if (strcmp(mode, "steps") == 0) {
        if (rank == 1) proc_set_step(5);
        proc_sum(1.0, "a sum");
        sleep_until_stopped();
    }
    fail("mode %s: no timeout", mode);
}
