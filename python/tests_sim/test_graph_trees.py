"""torch.compile's CUDA graph trees on the simulated GPU, under the allocator
named by ``QUILT_SIM_ALLOCATOR`` (see ``test_simulated_gpu.py``: torch's
classic allocator, its expandable segments, or ``quilt_torch.enable()``).

The trees are what ``mode="reduce-overhead"`` uses; here they run through
``backend="cudagraphs"`` (AOT autograd with eager kernels, then the graph
trees), because ``mode="reduce-overhead"`` compiles its kernels with triton,
whose launcher needs driver calls for loading and launching modules
(``cuFuncSetAttribute``, ...) that the driver double does not have. Shapes
are static (``dynamic=False``): with dynamic shapes, ``backend="cudagraphs"``
fails under torch's own allocator too (a recording of one batch size
replayed with another's input).

Each test records graphs of a small model for two batch sizes, brought in
one after the other while the first one's outputs are alive, so that the
trees checkpoint their private pool and restore it
(``getCheckpointState``, ``setCheckpointPoolState``) and check its live
blocks against the tensors they know (``checkPoolLiveAllocations``, with
torch's slow-path assertions on). Afterwards every byte comes back:
``memory_allocated`` as before, and after ``empty_cache`` no more reserved
than before. Kernels compute nothing on the simulated GPU, so values are not
checked, only shapes, the trees' calls and the memory.
"""

import gc
import os
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor import cudagraph_trees  # noqa: E402

# The pool calls of the trees, counted (the trees look them up on torch._C
# at each call).
POOL_CALLS = {
    "_cuda_getCheckpointState": 0,
    "_cuda_setCheckpointPoolState": 0,
    "_cuda_checkPoolLiveAllocations": 0,
}


def _count(name):
    original = getattr(torch._C, name)

    def counted(*args):
        POOL_CALLS[name] += 1
        return original(*args)

    setattr(torch._C, name, counted)


for _name in POOL_CALLS:
    _count(_name)

REPLAYS = [0]
_run_graph = cudagraph_trees.CUDAGraphNode.run_graph


def _counted_run_graph(self):
    REPLAYS[0] += 1
    return _run_graph(self)


cudagraph_trees.CUDAGraphNode.run_graph = _counted_run_graph

BATCHES = (8, 16, 24)


def model():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 32),
    ).cuda()


def recorded_nodes(manager):
    """Every graph the trees recorded."""
    count = 0
    stack = [n for nodes in manager.roots.values() for n in nodes]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(c for nodes in node.children.values() for c in nodes)
    return count


class GraphTrees(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
        inductor_config.triton.slow_path_cudagraph_asserts = True
        inductor_config.triton.fast_path_cudagraph_asserts = True
        for k in POOL_CALLS:
            POOL_CALLS[k] = 0
        REPLAYS[0] = 0
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.allocated = torch.cuda.memory_allocated()
        self.reserved = torch.cuda.memory_reserved()

    def tearDown(self):
        inductor_config.triton.fast_path_cudagraph_asserts = False

    def run_trees(self, train):
        m = model()
        f = torch.compile(m, backend="cudagraphs", dynamic=False)
        # In inference, a second function after each call of the first, on a
        # buffer at a fixed address: a child graph of each batch's.
        g = torch.compile(lambda b: torch.relu(b * 2 + 1), backend="cudagraphs", dynamic=False)
        buffer = torch.zeros(1024, device="cuda")
        torch._dynamo.mark_static_address(buffer)
        # Each round brings in one more batch size: its warm-up and then its
        # recording come while the earlier batches' outputs are alive, in
        # the middle of replaying their graphs, which checkpoints the pool.
        for round_ in range(len(BATCHES) + 3):
            outputs = []
            if train:
                m.zero_grad(set_to_none=True)
            for n in BATCHES[: round_ + 1]:
                x = torch.randn(n, 64, device="cuda")
                if train:
                    y = f(x)
                else:
                    with torch.no_grad():
                        y = f(x)
                        outputs.append(g(buffer))
                self.assertEqual(tuple(y.shape), (n, 32))
                self.assertEqual(y.device.type, "cuda")
                self.assertEqual(y.requires_grad, train)
                outputs.append(y)
            if train:
                sum(y.sum() for y in outputs).backward()
                for param in m.parameters():
                    self.assertIsNotNone(param.grad)
                    self.assertEqual(param.grad.shape, param.shape)
                del param
            del outputs, y, x
        manager = cudagraph_trees.get_container(0).tree_manager
        checkpoints = manager.debug_checkpointing_counter
        # A forward per batch; in training a backward per forward.
        nodes = recorded_nodes(manager)
        self.assertGreaterEqual(nodes, len(BATCHES) * (2 if train else 1))
        del manager
        self.assertGreaterEqual(checkpoints, 1, "the trees never checkpointed their pool")
        self.assertGreaterEqual(POOL_CALLS["_cuda_setCheckpointPoolState"], 1)
        self.assertGreaterEqual(POOL_CALLS["_cuda_getCheckpointState"], nodes)
        self.assertGreater(POOL_CALLS["_cuda_checkPoolLiveAllocations"], 0)
        self.assertGreater(REPLAYS[0], 0, "no graph was replayed")

        # Everything back once the model, the compiled function and the trees go.
        del f, g, m, buffer
        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
        gc.collect()
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.memory_allocated(), self.allocated)
        torch.cuda.empty_cache()
        self.assertLessEqual(torch.cuda.memory_reserved(), self.reserved)

    def test_inference_with_two_batch_sizes(self):
        self.run_trees(train=False)

    def test_training_forward_and_backward_with_two_batch_sizes(self):
        self.run_trees(train=True)


if __name__ == "__main__":
    unittest.main()
