"""HybridAdamW across os.fork(): a child that keeps using the optimizer it inherited (CPU parameters)
steps on as torch's AdamW would, with or without ``model=`` (whose updates outlive ``step()``), and
the parent goes on too; neither ever waits on threads that are not in its process. Each scenario runs
in a subprocess with a deadline: before the fix the child hung in its first wait."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hytrain

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

ROOT = str(Path(hytrain.__file__).resolve().parents[1])  # the hytrain under test, for the subprocess

PRELUDE = textwrap.dedent("""
    import copy, os, sys, warnings
    import torch
    import hytrain

    warnings.filterwarnings("ignore", "This process .* is multi-threaded")  # (the fork is the point)
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
            self.out = torch.nn.Linear(16, 4)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.out(x)

    X = [torch.randn(5, 8) for _ in range(8)]

    def train(model, opt, batches):
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if isinstance(opt, hytrain.HybridAdamW):
            opt.synchronize()

    def reference(start, batches, hooks):
        # torch's AdamW, and the same HybridAdamW never forked, over copies of the starting model
        ref, same = copy.deepcopy(start), copy.deepcopy(start)
        train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), batches)
        opt = hytrain.HybridAdamW(same.parameters(), lr=1e-2, workers=2, **({"model": same} if hooks else {}))
        train(same, opt, batches)
        opt.synchronize()
        return ref, same

    def in_child(body):
        # The forked child runs body() and exits: 0 when it passed, 1 when it raised (and says which).
        try:
            body()
            print("child ok", flush=True)
            code = 0
        except BaseException as e:
            print("child failed:", repr(e), flush=True)
            code = 1
        os._exit(code)

    def wait_child(pid):
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child failed"

    def agree(model, ref, same):
        for p, r, s in zip(model.parameters(), ref.parameters(), same.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)  # as test_hybrid_adam's comparisons
            assert torch.equal(p, s), "not the unforked HybridAdamW's result bit for bit"
""")


def run(body, timeout=60):
    """Runs PRELUDE + body in a new session (its forked children with it); returns its stdout. A run
    past ``timeout`` fails the test, and the whole session is killed."""
    # No GPU in the session: where torch sees one, its autograd engine starts a thread per device at
    # the first backward and then refuses any backward in a forked child (torch's own limit, whatever
    # the optimizer). These runs are about CPU parameters.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the children too: a hung child outlives its parent
        out, err = proc.communicate()
        pytest.fail(f"hung (no result in {timeout} s); output:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out + err
    return out


@pytest.mark.parametrize("with_model", [False, True], ids=["plain", "model_hooks"])
def test_an_inherited_optimizer_keeps_stepping_in_the_child_and_the_parent(with_model):
    # With model= the updates of the second step are still in flight when the process forks: the
    # fork waits for them, and the child's next forward waits for nothing that is not there.
    out = run(f"""
        WITH_MODEL = {with_model}
        model = Net()
        start = copy.deepcopy(model)
        opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, workers=2,
                                  **({{"model": model}} if WITH_MODEL else {{}}))
        for x in X[:2]:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        ref, same = reference(start, X, WITH_MODEL)
        def child():
            train(model, opt, X[2:])  # (train synchronizes at the end)
            agree(model, ref, same)
            sd = opt.state_dict()
            assert all(int(e["step"]) == len(X) for e in sd["state"].values())

        pid = os.fork()
        if pid == 0:
            in_child(child)
        train(model, opt, X[2:])
        agree(model, ref, same)
        wait_child(pid)
        print("parent ok")
    """)
    assert "child ok" in out and "parent ok" in out


def test_a_child_that_exits_normally_and_a_grandchild():
    # The child leaves through the interpreter's normal exit (the optimizer's teardown waits for its
    # updates and joins its workers: the ones made in the child), after forking a grandchild of its own.
    out = run("""
        model = Net()
        start = copy.deepcopy(model)
        opt = hytrain.HybridAdamW(model.parameters(), lr=1e-2, workers=2, model=model)
        train(model, opt, X[:2])
        ref, same = reference(start, X, True)
        pid = os.fork()
        if pid == 0:
            train(model, opt, X[2:5])
            grand = os.fork()
            if grand == 0:
                train(model, opt, X[5:])
                agree(model, ref, same)
                print("grandchild ok", flush=True)
                os._exit(0)
            _, status = os.waitpid(grand, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            train(model, opt, X[5:])
            agree(model, ref, same)
            print("child ok", flush=True)
            sys.exit(0)  # the interpreter's exit: finalizers, the native engine's destructor
        wait_child(pid)
        print("parent ok")
    """)
    assert "grandchild ok" in out and "child ok" in out and "parent ok" in out


def test_the_native_engine_in_a_child_never_waits_for_the_parents_workers():
    # A bare native engine (no optimizer: nothing quiesces it before the fork) with an update in
    # flight: in the child, waiting for that block either finds it complete (it was, at the fork) or
    # raises -- some of its slices may not have been updated -- and the child's own submits run on
    # workers started there.
    out = run("""
        nat = hytrain.native()
        pool = hytrain.PinnedPool("512MiB")
        table = nat.ParamTable()
        table.set_groups([nat.GroupHyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False)])

        def param(n):
            master, m, v = pool.copy_of(torch.randn(n)), pool.zeros(n), pool.zeros(n)
            step, grad = torch.zeros(()), torch.randn(n)
            h = table.add(master=master.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                          max_exp_avg_sq=0, step=step.data_ptr(), grad=grad.data_ptr(), dtype=0, copy=0,
                          numel=n, group=0, amsgrad=False)
            return h, master, m, v, grad, step  # (all kept alive: the table holds their addresses)

        engine = nat.UpdateEngine(1, 1 << 12, "scalar")
        # (The child's own tensors stay below torch's parallel grain: torch's OpenMP pool, used by the
        # parent, does not survive a fork either.)
        big, small = param(1 << 23), param(1 << 12)
        want = small[1].clone(), torch.zeros(1 << 12), torch.zeros(1 << 12)
        hytrain.adamw_step(want[0], small[4], want[1], want[2], step=1, lr=1e-2, weight_decay=0.01, simd="scalar")
        engine.submit(0, table, [big[0]], [big[4].data_ptr()], [big[1].data_ptr()], 1.0)  # (fp32: in place)
        def child():
            assert engine.inherited
            try:
                engine.wait(0)
            except RuntimeError as e:
                assert "forked while this block was being updated" in str(e), e
            engine.submit(1, table, [small[0]], [small[4].data_ptr()], [small[1].data_ptr()], 1.0)
            engine.wait(1)
            assert torch.equal(small[1], want[0]) and torch.equal(small[2], want[1])

        pid = os.fork()
        if pid == 0:
            in_child(child)
        engine.wait(0)
        assert not engine.inherited
        wait_child(pid)
        print("parent ok")
    """)
    assert "child ok" in out and "parent ok" in out


def test_forked_cuda_state_is_refused_with_a_clear_error():
    # CUDA cannot be used in a forked child: an inherited optimizer with its state on CUDA says so,
    # naming the fix, at its first use (the message and its check; CUDA itself is not needed here).
    from hytrain.hybrid import forks

    class Engine:
        inherited = True

    class Store:
        cuda = True

    class Launcher:
        engine, store = Engine(), Store()

    with pytest.raises(RuntimeError, match="forked child.*in the child.*'spawn'"):
        forks.check(Launcher())
    Launcher.store.cuda = False  # the CPU path: the engine starts its workers again instead
    forks.check(Launcher())
