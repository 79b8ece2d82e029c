#!/usr/bin/env python3
"""quilt_torch with real PyTorch on a simulated CUDA device (FakeGPU), by hand.

FakeGPU (github.com/FanBB2333/fakeGPU, MIT; not a dependency of this project
or its CI: it is in no package registry) builds fake libcuda/libcudart/
libcublas that run copies, memsets and matrix multiplies on host memory
(other kernels do nothing). Build it with CMake (its CPU simulation is on by
default), then, with the python that has torch (scripts/torch-venv.sh):

    FAKEGPU_BUILD=/path/to/fakeGPU/build \
        ~/.cache/quilt/torch-venv/bin/python scripts/torch_fakegpu_check.py

Each case runs in a process of its own, with QUILT_ALLOC_CONF=backend:host
and the FakeGPU libraries preloaded, as a user would: out of memory raises
torch.OutOfMemoryError naming the request and the next tensor keeps its bytes
(copies: FakeGPU runs no fill kernel), and the snapshot after it and
empty_cache carries segment events and device_free and _memory_viz stats and
trace run on it; torch.cuda.empty_cache() leaves Quilt nothing reserved;
set_per_process_memory_fraction caps Quilt; Tensor.record_stream reaches
Quilt (an event is recorded at the free); enable() refuses capacity:lots and
backend:sim; a small training loop leaves nothing allocated. Exits 0 when all
passed, 1 when one failed, 77 when FAKEGPU_BUILD or torch is missing.
"""

import os
import pickle
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
MiB = 1 << 20

CASES = {
    "oom": "backend:host,capacity:256MiB",
    "empty_cache": "backend:host,capacity:256MiB",
    "fraction": "backend:host,capacity:2GiB",
    "record_stream": "backend:host,capacity:256MiB",
    "train": "backend:host,capacity:256MiB",
    "refuse:capacity": "backend:host,capacity:lots",
    "refuse:sim": "backend:sim",
}


def main():
    build = os.environ.get("FAKEGPU_BUILD")
    if not build or not os.path.isfile(os.path.join(build, "libcuda.so.1")):
        print("skipped: set FAKEGPU_BUILD to a FakeGPU build folder (with libcuda.so.1)")
        return 77
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        print("skipped: no torch here ({})".format(exc))
        return 77
    libs = ["libcublas.so.12", "libcudart.so.12", "libcuda.so.1", "libnvidia-ml.so.1"]
    failed = []
    import tempfile

    work = tempfile.mkdtemp(prefix="quilt-fakegpu-")  # FakeGPU writes its report into the cwd
    for name, conf in CASES.items():
        env = dict(os.environ, QUILT_ALLOC_CONF=conf)
        env["LD_LIBRARY_PATH"] = build + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        env["LD_PRELOAD"] = ":".join(os.path.join(build, l) for l in libs)
        case = name.split(":")[0]
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), case],
            env=env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            universal_newlines=True,
            timeout=600,
        )
        ok = done.returncode == 0 and "CASE OK" in done.stdout
        lines = [l for l in done.stdout.splitlines() if "NumPy" not in l and "_conversion_method" not in l]
        print("{} {} ({})".format("passed" if ok else "FAILED", name, conf))
        for l in lines[-8:]:
            print("    " + l[:240])
        if not ok:
            failed.append(name)
    print("{} passed, {} failed".format(len(CASES) - len(failed), len(failed)))
    return 1 if failed else 0


def case_main(case):
    import quilt_torch

    MiB = 1 << 20
    if case == "refuse":
        try:
            quilt_torch.enable(); print("ACCEPTED"); raise SystemExit(1)
        except quilt_torch.QuiltError as e:
            print("refused:", type(e).__name__, e)
            print("CASE OK")
            return
    quilt_torch.enable()
    import torch
    print("cuda available", torch.cuda.is_available(), torch.cuda.device_count())
    if case == "oom":
        import tempfile

        snap_path = os.path.join(tempfile.mkdtemp(prefix="quilt-fakegpu-"), "snap.pickle")
        quilt_torch.record_history(True)
        a = torch.ones(10 * MiB // 4, device="cuda")
        try:
            torch.empty(300 * MiB, dtype=torch.uint8, device="cuda"); print("NO OOM"); raise SystemExit(1)
        except torch.OutOfMemoryError as e:
            print("OOM:", str(e)[:300])
        src = torch.arange(MiB, dtype=torch.float32)
        b = src.to("cuda")
        assert torch.equal(b.cpu(), src), "bytes lost"
        print("after the OOM: a 4 MiB tensor keeps its bytes")
        del a
        torch.cuda.empty_cache()
        quilt_torch.dump_snapshot(snap_path)
        snap = pickle.load(open(snap_path, "rb"))
        trace = snap["device_traces"][0]
        acts = sorted({t["action"] for t in trace})
        print("history actions", acts)
        assert {"segment_map", "segment_unmap"} <= set(acts), acts
        ooms = [t for t in trace if t["action"] == "oom"]
        assert len(ooms) == 1 and "device_free" in ooms[0], ooms
        for cmd in ("stats", "trace"):
            r = subprocess.run(
                [sys.executable, "-m", "torch.cuda._memory_viz", cmd, snap_path],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                universal_newlines=True,
            )
            assert r.returncode == 0, (cmd, r.stderr[-2000:])
        print("_memory_viz stats and trace ran on the snapshot")
        print("empty(0):", torch.empty(0, device="cuda").data_ptr(), repr(quilt_torch.last_error()))
    elif case == "empty_cache":
        x = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda"); del x
        print("reserved before", quilt_torch.memory_reserved())
        torch.cuda.empty_cache()
        print("reserved after", quilt_torch.memory_reserved())
        assert quilt_torch.memory_reserved() == 0
    elif case == "fraction":
        torch.cuda.set_per_process_memory_fraction(0.25)
        print("capacity", quilt_torch.memory_stats()["capacity_bytes"])
        try:
            torch.empty(600 * MiB, dtype=torch.uint8, device="cuda"); print("SERVED"); raise SystemExit(1)
        except torch.OutOfMemoryError as e:
            print("capped:", str(e)[:150])
    elif case == "record_stream":
        s = torch.cuda.Stream()
        x = torch.ones(4 * MiB // 4, device="cuda")
        with torch.cuda.stream(s):
            y = x * 2
        before = quilt_torch.memory_stats()["driver_calls"]
        x.record_stream(s)
        print("last_error after record_stream:", repr(quilt_torch.last_error()))
        del x
        after = quilt_torch.memory_stats()["driver_calls"]
        print("event_record", before["event_record"], "->", after["event_record"])
        assert after["event_record"] > before["event_record"], "record_stream did not reach Quilt"
    elif case == "train":
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(5):
            xb = torch.randn(32, 64).cuda(); yb = torch.randn(32, 10).cuda()
            loss = ((m(xb) - yb) ** 2).mean(); opt.zero_grad(); loss.backward(); opt.step()
        print("allocated during", quilt_torch.memory_allocated())
        del m, opt, xb, yb, loss
        import gc; gc.collect()
        print("allocated after", quilt_torch.memory_allocated())
        assert quilt_torch.memory_allocated() == 0
    print("CASE OK")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        case_main(sys.argv[1])
    else:
        sys.exit(main())
