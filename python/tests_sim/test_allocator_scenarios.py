"""torch's own allocator against Quilt's allocator class, on the simulated
GPU: every scenario of ``scripts/torch_allocator_check.py`` (torch's memory
APIs, out of memory, CUDA graphs and their private pools, MemPool, the graph
trees, a training loop), each in a process of its own under
torch's allocator and under ``quilt_torch.enable()``, and what they report
compared.

It runs both allocators itself, so it runs once: in the process of the
``quilt`` allocator (``QUILT_SIM_ALLOCATOR=quilt``, as the simulated-GPU
runner sets it), and is skipped under the others. The workers inherit the
simulated GPU's environment (``scripts/simulated-gpu.sh``).
"""

import os
import sys
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import torch_allocator_check  # noqa: E402  (the scenarios and their runner)

# What may differ between torch's allocator and Quilt, and why.
MAY_DIFFER = {
    "quilt_verdict": "Quilt's out-of-memory message ends with its verdict",
    "extras": "quilt_torch's own functions run under Quilt only",
    "late_enable": "enable() after CUDA was used is tried under Quilt only",
}


def worker(name, allocator):
    """The scenario in a fresh process, on the simulated GPU this process
    runs on (its environment is inherited, so no simulated-gpu.sh prefix)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.setdefault("QUILT_ALLOC_CONF", "backend:cuda")
    rc, result, out = torch_allocator_check.run_worker(name, allocator, [], env)
    return rc, result, out[-4000:]


@unittest.skipIf(ALLOCATOR != "quilt", "runs torch's allocator and Quilt itself, under the quilt run only")
class AllocatorScenarios(unittest.TestCase):
    def compare(self, name):
        results = {}
        for allocator in ("native", "quilt"):
            rc, result, out = worker(name, allocator)
            self.assertTrue(rc == 0 and result is not None, "{} under {} failed ({}):\n{}".format(name, allocator, rc, out))
            results[allocator] = result
        for key in set(results["native"]) | set(results["quilt"]):
            if key not in MAY_DIFFER:
                self.assertEqual(results["native"].get(key), results["quilt"].get(key), "{}: {}".format(name, key))
        return results

    def test_torchs_memory_apis(self):
        self.compare("apis")

    def test_out_of_memory(self):
        self.compare("oom")

    def test_cuda_graphs_keep_their_memory_until_deleted(self):
        r = self.compare("graphs")
        self.assertEqual(r["quilt"]["overlaps"], 0)

    def test_mempool(self):
        self.compare("mempool")

    def test_graph_trees_run(self):
        r = self.compare("compile_trees")
        self.assertEqual(r["quilt"]["checkpoint"], "works")

    def test_torch_snapshot_after_churn_on_two_streams(self):
        r = self.compare("churn_snapshot")
        self.assertTrue(r["quilt"]["two_streams"])

    def test_quilt_torchs_extras_under_enable(self):
        r = self.compare("quilt_extras")
        self.assertEqual(r["quilt"]["extras"], "ok")

    def test_enable_after_cuda_was_used_is_refused(self):
        r = self.compare("late_enable")
        self.assertEqual(r["quilt"]["late_enable"], "refused")

    def test_training_loop_leaks_nothing(self):
        r = self.compare("train")
        self.assertEqual(r["quilt"]["left"], 0)


if __name__ == "__main__":
    unittest.main()
