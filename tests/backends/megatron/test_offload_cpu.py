"""The Megatron backend's storage offload (polyrl/backends/megatron/offload.py) on CPU tensors: views into a shared
buffer (megatron's param.data / main_grad into its DDP buffers) see their values again after a round trip, released
storages come back as zeros, and the plan counts each storage once."""

from __future__ import annotations

import torch

from polyrl.backends.megatron.offload import StorageOffloader, arena_layout, plan_slots, summarize


def _state():
    buf = torch.arange(24, dtype=torch.float32)  # a DDP param buffer: params are views of it
    w1, w2 = buf[:8].view(2, 4), buf[8:].view(4, 4)
    grad = torch.zeros(24)  # the grad buffer, zero between steps
    g1 = grad[:8].view(2, 4)
    adam = {"exp_avg": torch.randn(24), "step": torch.tensor(3.0)}
    return buf, w1, w2, grad, g1, adam


def test_plan_dedups_storages_and_keep_wins():
    buf, w1, w2, grad, g1, adam = _state()
    slots = plan_slots([("weights", True, [w1, w2, None]), ("grads", False, [grad, g1, w1]),
                        ("optimizer", True, list(adam.values()))], device_type="cpu")
    assert [s.kind for s in slots] == ["weights", "grads", "optimizer", "optimizer"]
    assert [s.keep for s in slots] == [True, False, True, True]  # w1 seen as a grad too: still copied
    sizes = summarize(slots)
    assert sizes == {"weights": 96, "grads": 96, "optimizer": 96 + 4, "total": 292}


def test_round_trip_restores_views_and_zeroes_released():
    buf, w1, w2, grad, g1, adam = _state()
    before = [t.clone() for t in (w1, w2, adam["exp_avg"], adam["step"])]
    off = StorageOffloader(device_type="cpu", pin=False)
    sizes = off.offload([("weights", True, [w1, w2]), ("grads", False, [g1]), ("optimizer", True, list(adam.values()))])
    assert sizes["total"] == 96 + 96 + 100
    assert buf.untyped_storage().nbytes() == 0 and grad.untyped_storage().nbytes() == 0
    assert off.offload([("weights", True, [w1])]) == sizes  # already offloaded: nothing more happens
    off.onload()
    after = [w1, w2, adam["exp_avg"], adam["step"]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(buf, torch.arange(24, dtype=torch.float32))  # the buffer the views share, whole again
    assert torch.equal(grad, torch.zeros(24))
    w1.add_(1)  # still views of the one buffer
    assert float(buf[0]) == 1.0
    off.onload()  # not offloaded: nothing happens
    # a second round trip with the same layout reuses the host arenas
    arenas = off._arenas
    off.offload([("weights", True, [w1, w2]), ("optimizer", True, list(adam.values()))])
    off.onload()
    assert off._arenas is arenas and float(buf[0]) == 1.0


def test_arena_layout_packs_aligned_and_gives_large_ones_their_own():
    lay = arena_layout([100, 600, 300, 2000], arena_bytes=1024, align=512)
    assert lay == [(0, 0), (1, 0), (0, 512), (2, 0)]  # 600 does not fit after 100 (aligned to 512): a new arena


def test_megatron_state_reads_ddp_grad_buffers_beside_module_buffers():
    """megatron's DDP wrapper keeps its grad buffers in a `buffers` list that shadows nn.Module.buffers()."""
    from types import SimpleNamespace

    from polyrl.backends.megatron.offload import megatron_state

    class FakeDDP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(4, 2)
            self.module.register_buffer("inv_freq", torch.ones(3))
            grad = torch.zeros(10)
            self.module.weight.main_grad = grad[:8].view(2, 4)
            self.buffers = [SimpleNamespace(grad_data=grad)]
            self.expert_parallel_buffers = []

    ddp = FakeDDP()
    opt = SimpleNamespace(optimizer=torch.optim.AdamW(ddp.module.parameters()))
    groups = megatron_state([ddp], opt, [None])
    sizes = summarize(plan_slots(groups, device_type="cpu"))
    assert sizes == {"weights": 8 * 4 + 2 * 4 + 3 * 4, "grads": 10 * 4, "total": 92}


def test_released_grads_free_the_buffer_keep_its_views_and_come_back_as_zeros():
    """Between train steps the DDP grad buffers are emptied in place (Released) and refilled with zeros before the
    next backward: main_grad views write into the buffer again, and an offload meanwhile finds nothing to move there."""
    from polyrl.backends.megatron.offload import Released
    buf, w1, w2, grad, g1, adam = _state()
    rg = Released([grad, g1, None], device_type="cpu")
    assert rg.nbytes == 96 and len(rg.slots) == 1
    grad.fill_(7.0)
    rg.release()
    assert grad.untyped_storage().nbytes() == 0
    off = StorageOffloader(device_type="cpu", pin=False)
    assert off.offload([("weights", True, [w1, w2]), ("grads", False, [grad, g1])]) == {"weights": 96, "total": 96}
    off.onload()
    assert grad.untyped_storage().nbytes() == 0  # still released: the next train step makes it
    rg.materialize()
    assert torch.equal(grad, torch.zeros(24))
    g1.add_(1.0)  # the view writes into the one buffer again
    assert float(grad[0]) == 1.0 and float(grad[8]) == 0.0
    rg.materialize()  # already there: its values stay
    assert float(grad[0]) == 1.0
    rg.release()
    rg.materialize(zero=False)  # for a caller that zeroes next (train_step's zero_grad_buffer): bytes back, unwritten
    assert grad.untyped_storage().nbytes() == 96
    g1.fill_(2.0)
    assert float(grad[0]) == 2.0  # the views write into the refilled buffer


def test_onload_skipping_the_step_state_then_offload_again_keeps_every_value():
    """--offload-train brings the FP32 main parameters and Adam moments back only for the optimizer step: an onload that
    skips them refills the rest; an offload before the step sends back only what came back (the skipped kinds' host
    copies stay as they were); the step's full onload then restores every value."""
    from polyrl.backends.megatron.offload import STEP_ONLY
    buf, w1, w2, grad, g1, adam = _state()
    main = torch.randn(24)  # FP32 main parameters: a storage of their own
    want = {"buf": buf.clone(), "main": main.clone(), "exp_avg": adam["exp_avg"].clone()}
    groups = [("weights", True, [w1, w2]), ("main_params", True, [main]), ("optimizer", True, list(adam.values())),
              ("grads", False, [grad])]
    off = StorageOffloader(device_type="cpu", pin=False)
    off.offload(groups)
    off.onload(skip=STEP_ONLY)
    assert torch.equal(buf, want["buf"]) and torch.equal(grad, torch.zeros(24))
    assert main.untyped_storage().nbytes() == 0 and adam["exp_avg"].untyped_storage().nbytes() == 0 and off.offloaded
    w1.add_(1.0)  # a weight changes while the step's state is away (the host copy of the weights must follow)
    want["buf"][:8] += 1.0
    assert off.offload(groups)["total"] == 96 + 96 + 96 + 100
    assert buf.untyped_storage().nbytes() == 0 and all(off._away)
    off.onload(skip=STEP_ONLY)
    off.onload()  # the step: the rest comes back
    assert not off.offloaded
    assert torch.equal(buf, want["buf"]) and torch.equal(main, want["main"])
    assert torch.equal(adam["exp_avg"], want["exp_avg"]) and float(adam["step"]) == 3.0


def test_released_weights_during_the_step_come_back_for_the_writer():
    """The BF16 weights are emptied for the optimizer step and given their bytes back (unwritten) by the inner
    optimizer's post-step hook, before megatron copies the main parameters into them: views stay valid."""
    from polyrl.backends.megatron.offload import Released
    buf, w1, w2, grad, g1, adam = _state()
    rw = Released([w1, w2], device_type="cpu", kind="weights")
    assert [s.kind for s in rw.slots] == ["weights"] and rw.nbytes == 96 and not rw.released
    rw.release()
    assert rw.released and buf.untyped_storage().nbytes() == 0
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    opt.register_step_post_hook(lambda *_: rw.materialize(zero=False))
    p.grad = torch.ones(3)
    opt.step()
    assert not rw.released and buf.untyped_storage().nbytes() == 96
    main = torch.arange(24, dtype=torch.float32) * 2
    buf.copy_(main)  # megatron's main -> model copy writes every byte
    assert torch.equal(w2, main[8:].view(4, 4))


def test_a_new_layout_frees_the_old_arenas_before_making_its_own(monkeypatch):
    """When the state grows (Adam's moments appear at the first step) the host arenas are remade: the old ones must be
    gone before the new ones are allocated, or the host holds both layouts at once."""
    import weakref

    from polyrl.backends.megatron import offload as off_mod
    buf, w1, w2, grad, g1, adam = _state()
    off = StorageOffloader(device_type="cpu", pin=False)
    off.offload([("weights", True, [w1, w2])])
    off.onload()
    old = [weakref.ref(t) for t in off._arenas]
    seen_alive = []
    real_empty = torch.empty

    def spy(*args, **kw):
        seen_alive.append(sum(r() is not None for r in old))
        return real_empty(*args, **kw)

    monkeypatch.setattr(off_mod.torch, "empty", spy)
    off.offload([("weights", True, [w1, w2]), ("optimizer", True, list(adam.values()))])
    monkeypatch.undo()
    assert seen_alive and max(seen_alive) == 0
    off.onload()
    assert torch.equal(buf, torch.arange(24, dtype=torch.float32))


def test_a_read_only_onload_of_the_weights_is_emptied_again_without_a_copy():
    """What an export does under --offload-train: only the weights come back (the FP32 main parameters, Adam moments
    and gradient buffers stay away), and put_back empties them again without copying (their host copy still holds
    their values: a change made in between is not kept, which is why only readers use it)."""
    buf, w1, w2, grad, g1, adam = _state()
    main = torch.randn(24)
    want = {"buf": buf.clone(), "main": main.clone(), "exp_avg": adam["exp_avg"].clone()}
    groups = [("weights", True, [w1, w2]), ("main_params", True, [main]), ("optimizer", True, list(adam.values())),
              ("grads", False, [grad])]
    off = StorageOffloader(device_type="cpu", pin=False)
    off.offload(groups)
    back = off.onload(only=("weights",))
    assert [off.slots[i].kind for i in back] == ["weights"] and torch.equal(buf, want["buf"])
    assert main.untyped_storage().nbytes() == 0 and grad.untyped_storage().nbytes() == 0
    w1.add_(1.0)  # a change put_back does not copy to the host: the next onload shows the host copy's values
    off.put_back(back)
    assert buf.untyped_storage().nbytes() == 0 and all(off._away)
    assert off.onload() and torch.equal(buf, want["buf"]) and torch.equal(main, want["main"])
    assert torch.equal(adam["exp_avg"], want["exp_avg"])
    assert off.put_back([]) is None and off.onload() == []  # nothing away: nothing to do
