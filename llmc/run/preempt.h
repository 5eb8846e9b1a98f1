/*
 * Preemption: SIGTERM, SIGINT and SIGUSR1 (what schedulers send before a
 * time limit or a preemption) ask the run to stop. The step under way
 * finishes, the ranks agree that one of them was asked, a complete
 * checkpoint of that step is written when -o is set, and the process exits
 * with PREEMPT_EXIT_STATUS, so a retry loop or a requeued job resumes it
 * with -y 1 (without -o: 128 + signal, as the signal itself would, since
 * there is nothing to resume). A second signal exits at once (status 128 + signal); whatever
 * it interrupts is left under a temporary name that resume ignores.
 */
#ifndef REMAT_PREEMPT_H
#define REMAT_PREEMPT_H

#include <signal.h>
#include "../core/utils.h"

#define PREEMPT_EXIT_STATUS 75 /* EX_TEMPFAIL: stopped on request, resumable */

static volatile sig_atomic_t remat_stop_signal = 0;

static void preempt_on_signal(int sig) {
    if (remat_stop_signal) _exit(128 + sig);
    remat_stop_signal = sig;
}

static inline void preempt_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = preempt_on_signal;
    sa.sa_flags = SA_RESTART; /* file reads and writes carry on through the first signal */
    sigemptyset(&sa.sa_mask);
    const int sigs[3] = {SIGTERM, SIGINT, SIGUSR1};
    for (int i = 0; i < 3; i++)
        if (sigaction(sigs[i], &sa, NULL) != 0) fail("cannot install the handler of signal %d (%s)", sigs[i], strerror(errno));
}

static inline const char* preempt_signal_name(int sig) {
    return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : sig == SIGUSR1 ? "SIGUSR1" : "a signal";
}

#endif
