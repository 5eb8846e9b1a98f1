"""OpenMP defaults of the CPU trainer on shared cores (issue 44, 8;
llmc/cpu/cpu_threads.h): the passive wait policy reaches the OpenMP runtime
(it is in the environment the program was executed with, which is what
libgomp reads when it loads), unless the user set a policy or a spin count;
threads come from the CPUs the process may run on and the cgroup's CPU
quota, unless OMP_NUM_THREADS; none of it changes a result's bits; --help
says how to override."""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO, STEP_RE, binary, datafile, run

MODEL = ["-e", "d6", "--layers", "2", "--channels", "32", "--heads", "2", "--vocab-size", "64", "--max-seq-len", "32",
         "-b", "4", "-t", "32", "-j", "", "-s", "0", "-v", "0"]
OMP_VARS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "REMAT_OMP_DEFAULTS", "REMAT_TEST_CGROUP_ROOT")


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    p = tmp_path_factory.mktemp("threads") / "train.bin"
    datafile.write_shard(p, np.random.default_rng(8).integers(0, 64, 20000))
    return p


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    env.update(extra)
    return env


def trainer(shard, *extra, env=None, prefix=()):
    res = subprocess.run([*prefix, str(binary("train_gpt_cpu")), *MODEL, "-i", str(shard), *extra], capture_output=True, text=True,
                         env=env if env is not None else clean_env(), timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return res


def threads_line(res):
    m = re.search(r"^threads: (\d+) \(OpenMP: (.*)\)$", res.stdout, re.M)
    assert m, res.stdout
    return int(m.group(1)), m.group(2)


def executed_environment(shard, env):
    """The environment the running trainer was last executed with
    (/proc/PID/environ: what the OpenMP runtime read when it loaded), read
    once it has printed its thread line."""
    proc = subprocess.Popen([str(binary("train_gpt_cpu")), *MODEL, "-i", str(shard), "-x", "100000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = ""
        while not line.startswith("threads:"):
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        raw = open(f"/proc/{proc.pid}/environ", "rb").read()
    finally:
        proc.kill()
        proc.communicate()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv), line


def test_the_passive_wait_policy_reaches_the_runtime(shard):
    env, line = executed_environment(shard, clean_env())
    assert env.get("OMP_WAIT_POLICY") == "passive", line
    assert "wait policy passive, the trainer's default (OMP_WAIT_POLICY=active to spin)" in line, line


@pytest.mark.parametrize("var,value", [("OMP_WAIT_POLICY", "active"), ("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "10000")])
def test_a_policy_the_user_set_is_kept(shard, var, value):
    env, line = executed_environment(shard, clean_env(**{var: value}))
    assert env.get(var) == value and "REMAT_OMP_DEFAULTS" not in env, line
    if var == "GOMP_SPINCOUNT":
        assert "OMP_WAIT_POLICY" not in env and f"spin count {value} (GOMP_SPINCOUNT)" in line, line
    else:
        assert f"wait policy {value} (OMP_WAIT_POLICY)" in line, line


def test_threads_follow_the_cpus_the_process_may_use(shard):
    cpus = len(os.sched_getaffinity(0))
    n, why = threads_line(trainer(shard, "-x", "1"))
    assert n == cpus and why.startswith("the CPUs this process may run on, OMP_NUM_THREADS=N sets them"), why
    if shutil.which("taskset"):
        n, _ = threads_line(trainer(shard, "-x", "1", prefix=("taskset", "-c", str(min(os.sched_getaffinity(0))))))
        assert n == 1
    n, why = threads_line(trainer(shard, "-x", "1", env=clean_env(OMP_NUM_THREADS="3")))
    assert n == 3 and why.startswith("OMP_NUM_THREADS;"), why


@pytest.mark.parametrize("files,quota", [
    ({"cpu.max": "50000 100000\n"}, 1),            # half a CPU: one thread
    ({"cpu.max": "150000 100000\n"}, 2),           # 1.5 CPUs: two threads keep it busy
    ({"cpu.max": "max 100000\n"}, None),           # no limit
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),   # v1, no limit
])
def test_threads_stay_within_the_cgroup_cpu_quota(shard, tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cpus = len(os.sched_getaffinity(0))
    n, why = threads_line(trainer(shard, "-x", "1", env=clean_env(REMAT_TEST_CGROUP_ROOT=str(tmp_path))))
    want = min(cpus, quota) if quota else cpus
    assert n == want, why
    assert why.startswith("the cgroup's CPU quota" if quota and quota < cpus else "the CPUs this process may run on"), why


def test_the_defaults_change_no_bits(shard):
    """Wait policy and thread count change when threads run, not what they sum."""
    ref = trainer(shard, "-x", "4", env=clean_env(OMP_WAIT_POLICY="active", OMP_NUM_THREADS="1"))
    got = trainer(shard, "-x", "4")
    assert STEP_RE.findall(got.stdout) and [m[:4] for m in STEP_RE.findall(got.stdout)] == [m[:4] for m in STEP_RE.findall(ref.stdout)]


def test_help_says_how_to_override():
    out = run([binary("train_gpt_cpu"), "--help"], check=True).stdout
    env = out.split("\nenvironment", 1)[1]
    assert re.search(r"^  OMP_NUM_THREADS=N .*\[the CPUs this process may run on", env, re.M), env
    assert re.search(r"^  OMP_WAIT_POLICY=S .*active: they spin.*\[passive", env, re.M), env
