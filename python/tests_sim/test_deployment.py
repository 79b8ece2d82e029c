"""What a real deployment meets, on the simulated GPU, under the allocator
named by ``QUILT_SIM_ALLOCATOR`` (see ``test_simulated_gpu.py``): a process
that uses only ``cuda:1`` has no context on device 0; a ``fork()`` child that
touches CUDA gets torch's "Cannot re-initialize CUDA in forked subprocess"
(from Quilt too) rather than a deadlock; the history's annotations are
bounded by ``max_entries`` and go with ``_record_memory_history(None)`` and
``clear_history``; ranks of ``torch.distributed`` over gloo, launched as
torchrun launches them, all-reduce CUDA tensors and exit cleanly (status 0,
no C++ ``terminate``); under Quilt, a tensor of a sleeping tag freed is given
back at the wake; torch's peer access between two devices reaches every
page mapped before and after (``cuMemGetAccess``). Those that need a
process of their own run one
(``sys.executable`` with this environment, so on the same simulated GPU and
allocator).
"""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

MiB = 1 << 20
FORK_ERROR = "Cannot re-initialize CUDA in forked subprocess"

# The prologue of a program of its own: the allocator under test, as here.
PROLOGUE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {python!r})
    if os.environ.get("QUILT_SIM_ALLOCATOR") == "quilt":
        import quilt_torch
        quilt_torch.enable()
    import torch
    """
).format(python=os.path.join(REPO, "python"))


def run_program(body, timeout=120):
    """Run ``PROLOGUE + body`` in a python of its own; (exit code, output)."""
    done = subprocess.run(
        [sys.executable, "-c", PROLOGUE + textwrap.dedent(body)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        universal_newlines=True,
        timeout=timeout,
        cwd=REPO,
    )
    return done.returncode, done.stdout


class Deployment(unittest.TestCase):
    def test_a_process_on_cuda_1_only_has_no_context_on_device_0(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("needs two devices (QUILT_CUDA_DOUBLE_DEVICES=2 or more)")
        rc, out = run_program(
            """
            import ctypes
            torch.cuda.set_device(1)
            x = torch.ones(1 << 20, device="cuda:1")
            y = (x * 2).sum()
            torch.cuda.synchronize()
            cu = ctypes.CDLL("libcuda.so.1")
            def active(device):
                flags, on = ctypes.c_uint(), ctypes.c_int()
                assert cu.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(on)) == 0
                return on.value
            print("ACTIVE", active(0), active(1))
            """
        )
        self.assertEqual(rc, 0, out)
        self.assertIn("ACTIVE 0 1", out, "device 0's primary context is active (or device 1's is not)")

    def test_a_forked_child_touching_cuda_gets_torchs_error_not_a_deadlock(self):
        keep = torch.ones(MiB, device="cuda")  # CUDA state in the parent
        # Another thread allocating and freeing meanwhile: at the fork it may
        # hold the allocator's locks, which the child must never wait for.
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                t = torch.empty(4096, device="cuda")
                del t

        worker = threading.Thread(target=churn)
        worker.start()
        try:
            time.sleep(0.05)
            if ALLOCATOR == "quilt":
                held = quilt_torch._clib._lock
                held.acquire()  # as another thread inside quilt_torch would
            try:
                pid = os.fork()
            finally:
                if ALLOCATOR == "quilt":
                    held.release()
            if pid == 0:  # the child
                code = 0
                try:
                    try:
                        torch.empty(16, device="cuda")
                        code |= 1
                    except RuntimeError as e:
                        code |= 0 if FORK_ERROR in str(e) else 2
                    if ALLOCATOR == "quilt":
                        for call in (
                            lambda: quilt_torch.memory_stats(0),
                            lambda: quilt_torch.memory_allocated(0),
                            lambda: quilt_torch.empty_cache(),
                        ):
                            try:
                                call()
                                code |= 4
                            except quilt_torch.QuiltError as e:
                                code |= 0 if FORK_ERROR in str(e) else 8
                        if quilt_torch._library().quilt_in_forked_child() != 1:
                            code |= 16
                finally:
                    os._exit(code)
            deadline = time.time() + 60
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.time() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    self.fail("the forked child hung (a deadlock)")
                time.sleep(0.05)
            self.assertTrue(os.WIFEXITED(status), status)
            self.assertEqual(os.WEXITSTATUS(status), 0, "child failures (bits): {}".format(os.WEXITSTATUS(status)))
        finally:
            stop.set()
            worker.join()
        # The parent goes on.
        self.assertEqual(keep.sum().device.type, "cuda")
        if ALLOCATOR == "quilt":
            self.assertEqual(quilt_torch._library().quilt_in_forked_child(), 0)
            self.assertNotIn("error", quilt_torch.memory_stats(0))

    def test_many_ranks_all_reduce_cuda_tensors_and_exit_cleanly(self):
        # As torchrun runs them: one process per rank, RANK and WORLD_SIZE in
        # the environment, a TCP rendezvous on a free port; rank r on
        # cuda:(r mod devices). Each all-reduces CUDA tensors (gloo copies
        # them through the host), frees, barriers, destroys the group and
        # exits. A rank of an earlier build sometimes aborted at exit
        # ("terminate called without an active exception"): every rank of
        # every round must exit 0 with no such line.
        import socket

        world, rounds = 4, 2
        body = """
            import torch.distributed as dist
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=world)
            for step in range(3):
                t = torch.tensor([float(rank + 1 + step)] * 4096).to(dev)
                held = torch.empty((step + 1) << 20, dtype=torch.uint8, device=dev)
                dist.all_reduce(t)
                want = world * (world + 1) / 2 + world * step
                assert t.cpu()[0].item() == want, (t.cpu()[0].item(), want)
                del held, t
            dist.barrier()
            dist.destroy_process_group()
            print("RANK", rank, "DONE", flush=True)
        """
        for r in range(rounds):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ranks = []
            for rank in range(world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), INIT="tcp://127.0.0.1:{}".format(port))
                ranks.append(
                    subprocess.Popen(
                        [sys.executable, "-c", PROLOGUE + textwrap.dedent(body)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        universal_newlines=True,
                        cwd=REPO,
                        env=env,
                    )
                )
            for rank, p in enumerate(ranks):
                try:
                    out, _ = p.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    for q in ranks:
                        q.kill()
                    self.fail("round {}: rank {} hung".format(r, rank))
                self.assertEqual(p.returncode, 0, "round {}: rank {}:\n{}".format(r, rank, out))
                self.assertNotIn("terminate called", out)
                self.assertIn("RANK {} DONE".format(rank), out)

    def test_annotations_are_bounded_and_go_with_the_history(self):
        memory = torch.cuda.memory
        torch.empty(16, device="cuda")

        def annotations():
            return memory._snapshot().get("external_annotations", [])

        try:
            memory._record_memory_history(max_entries=8, global_record_annotations=True)
            for i in range(50):
                with torch.profiler.record_function("step{}".format(i)):
                    t = torch.empty(100 + i, device="cuda")
            names = [a["name"] for a in annotations()]
            self.assertEqual(len(names), 8, "not bounded by max_entries")
            self.assertEqual(names[-1], "step49", "not the last ones")
            # _record_memory_history(None) stops and forgets them.
            memory._record_memory_history(enabled=None)
            self.assertEqual(annotations(), [])
            memory._record_memory_history(max_entries=8, global_record_annotations=True)
            self.assertEqual(annotations(), [], "came back after a stop")
            with torch.profiler.record_function("kept"):
                t = torch.empty(16, device="cuda")
            self.assertEqual(len(annotations()), 2)  # START and END
            # Recording again keeps them; clear_history clears them.
            memory._record_memory_history(max_entries=8, global_record_annotations=True)
            self.assertEqual(len(annotations()), 2)
            memory._record_memory_history(max_entries=8, clear_history=True)
            self.assertEqual(annotations(), [])
            # (torch's own allocator writes a "snapshot" entry at each snapshot.)
            trace = memory._snapshot()["device_traces"][0]
            self.assertEqual([e for e in trace if e["action"] != "snapshot"], [])
        finally:
            memory._record_memory_history(enabled=None)
        del t

    @unittest.skipIf(ALLOCATOR == "classic", "cudaMalloc memory is reached through the contexts' peer access, not per mapping")
    def test_peer_access_maps_every_page_for_the_peer_now_and_later(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("needs two devices (QUILT_CUDA_DOUBLE_DEVICES=2 or more)")
        cu = ctypes.CDLL("libcuda.so.1")

        class Location(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        def readwrite(device, t):
            """Whether ``device`` may read and write every 2 MiB of ``t``."""
            flags = ctypes.c_ulonglong()
            where = Location(1, device)  # CU_MEM_LOCATION_TYPE_DEVICE
            ptr = t.data_ptr()
            for at in range(ptr, ptr + t.numel() * t.element_size(), 2 * MiB):
                rc = cu.cuMemGetAccess(ctypes.byref(flags), ctypes.byref(where), ctypes.c_ulonglong(at))
                if rc != 0 or flags.value != 3:  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                    return False
            return True

        host = torch.arange(6 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
        on0 = host.to("cuda:0")
        on1 = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda:1")
        before = (readwrite(1, on0), readwrite(0, on1))
        # A copy between the devices makes torch enable peer access both
        # ways (enablePeerAccess): a kernel of either device may then touch
        # the other's memory, which must be mapped for it.
        on1.copy_(on0)
        on0.copy_(on1)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(on1.cpu(), host))
        self.assertTrue(readwrite(1, on0), "device 0's memory mapped before is not mapped for device 1")
        self.assertTrue(readwrite(0, on1), "device 1's memory mapped before is not mapped for device 0")
        later = torch.empty(9 * MiB, dtype=torch.uint8, device="cuda:0")
        self.assertTrue(readwrite(1, later), "device 0's memory mapped afterwards is not mapped for device 1")
        self.assertEqual(before[0] and before[1], False, "peer access was there before any copy")

    @unittest.skipIf(ALLOCATOR != "quilt", "tags are quilt_torch's")
    def test_a_sleeping_tags_tensor_freed_is_given_back_at_the_wake(self):
        gc.collect()
        base = torch.cuda.memory_allocated()
        host = torch.arange(2 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
        with quilt_torch.tag("deployment-weights"):
            kept = host.to("cuda")
            gone = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        quilt_torch.sleep("deployment-weights")
        # torch's deleter while the tag sleeps: taken (it was refused, and
        # the block leaked), and counted until the wake.
        del gone
        gc.collect()
        self.assertEqual(torch.cuda.memory_allocated(), base + 10 * MiB)
        quilt_torch.wake("deployment-weights")
        self.assertEqual(torch.cuda.memory_allocated(), base + 2 * MiB, "the freed tensor leaked")
        self.assertTrue(torch.equal(kept.cpu(), host))
        del kept
        gc.collect()
        self.assertEqual(torch.cuda.memory_allocated(), base)


if __name__ == "__main__":
    unittest.main()
