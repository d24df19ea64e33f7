"""The GDN decode step's ops: Triton kernels against their torch references (gates, one-token
causal conv with per-slot state incl. fresh sequences and a shared padding slot, the one-token
delta rule with its state updated in its slot, the multi-row delta rule of a verify's rows with
its per-row snapshots and dead rows, gated RMSNorm), float32 tightly and bf16 within
bf16 rounding; under the Triton interpreter on CPU and on a GPU."""
import torch
from triton_interpreter import triton_check_tests

from qsaserve.ops.gdn.decode_ops import (conv1d_decode_reference_, conv1d_decode_rows_reference_,
                                         delta_rule_decode_reference_,
                                         delta_rule_decode_rows_reference_, gated_rms_norm,
                                         gdn_gates_reference)


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def check_decode_ops(device, dtype, gates, conv_, norm):
    g = torch.Generator().manual_seed(1)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    dev = lambda x: x.to(device)  # noqa: E731
    # Gates, with a projection large enough to cross softplus' threshold.
    b, a = r(5, 12), r(5, 12, scale=10.0)
    a_log, dt = r(12), r(12)
    want = gdn_gates_reference(b, a, a_log, dt)
    got = gates(dev(b), dev(a), dev(a_log), dev(dt))
    torch.testing.assert_close(got[0].cpu(), want[0], **_tol(dtype))
    torch.testing.assert_close(got[1].cpu(), want[1], **_tol(torch.float32 if dtype == torch.float32 else dtype))
    assert got[1].dtype == torch.float32
    # Conv: 4 rows, slots 3, 0, 5, 5 (two padding rows share slot 5), row 1 fresh; C = 200, W = 4.
    x, w = r(4, 200), r(200, 1, 4, scale=0.5)
    states = r(7, 200, 3)
    slots = torch.tensor([3, 0, 5, 5])
    fresh = torch.tensor([False, True, False, False])
    ref_states = states.clone()
    want_y = conv1d_decode_reference_(x, w, ref_states, slots, fresh)
    dev_states = dev(states.clone())
    got_y = conv_(dev(x), dev(w), dev_states, dev(slots), dev(fresh))
    torch.testing.assert_close(got_y.cpu()[:3], want_y[:3], **_tol(dtype))
    torch.testing.assert_close(dev_states.cpu()[[0, 1, 2, 3, 4, 6]], ref_states[[0, 1, 2, 3, 4, 6]], atol=0, rtol=0)
    # Gated RMSNorm over [T, Hv, Dv], model-dtype and float32 weights.
    xo, z = r(3, 4, 48), r(3, 4, 48)
    for weight in (r(48), torch.randn(48, generator=g)):
        for act in ("silu", "sigmoid"):
            want = gated_rms_norm(xo, z, weight, 1e-6, act)
            got = norm(dev(xo), dev(z), dev(weight), 1e-6, act).cpu()
            torch.testing.assert_close(got, want, **_tol(dtype))


def check_delta_rule(device, dtype, step_):
    """4 rows: slots 2, 0, 4, 4 (the last two share a padding slot), row 1 fresh; Hk 2, Hv 4 (GVA),
    Dk 24 and Dv 48 (neither a power of two, Dv two 32-wide column tiles); states of decaying size."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(4, 2, 24, generator=g).to(dtype), torch.randn(4, 2, 24, generator=g).to(dtype)
    v = torch.randn(4, 4, 48, generator=g).to(dtype)
    decay = -torch.rand(4, 4, generator=g) * 2  # fp32 log decay
    beta = torch.sigmoid(torch.randn(4, 4, generator=g)).to(dtype)
    states = torch.randn(6, 4, 24, 48, generator=g) * 0.5
    slots, fresh = torch.tensor([2, 0, 4, 4]), torch.tensor([False, True, False, False])
    ref_states = states.clone()
    want = delta_rule_decode_reference_(q, k, v, decay, beta, ref_states, slots, fresh)
    dev_states = states.clone().to(device)
    got = step_(*(x.to(device) for x in (q, k, v, decay, beta)), dev_states, slots.to(device), fresh.to(device))
    assert got.dtype == dtype and got.shape == (4, 4, 48)
    torch.testing.assert_close(got.cpu()[:2], want[:2], **_tol(dtype))
    kept = [0, 1, 2, 3, 5]  # slot 4 holds whichever padding row wrote last
    torch.testing.assert_close(dev_states.cpu()[kept], ref_states[kept], atol=1e-5, rtol=1e-5)


def check_delta_rule_rows(device, dtype, rows_):
    """3 sequences x 3 rows (slots 2, 4 and the scratch 0 of a padding sequence, fresh); the last
    row of sequence 1 dead: against the reference, and against one-token steps row by row."""
    g = torch.Generator().manual_seed(3)
    b, n = 3, 3
    q, k = torch.randn(b, n, 2, 24, generator=g).to(dtype), torch.randn(b, n, 2, 24, generator=g).to(dtype)
    v = torch.randn(b, n, 4, 48, generator=g).to(dtype)
    decay = -torch.rand(b, n, 4, generator=g) * 2
    beta = torch.sigmoid(torch.randn(b, n, 4, generator=g)).to(dtype)
    states = torch.randn(6, 4, 24, 48, generator=g) * 0.5
    slots, fresh = torch.tensor([2, 4, 0]), torch.tensor([False, False, True])
    live = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    snaps, snap_rows = torch.zeros(8, 4, 24, 48), torch.tensor([[1, 2], [3, 4], [0, 0]])
    ref_states, ref_snaps = states.clone(), snaps.clone()
    want = delta_rule_decode_rows_reference_(q, k, v, decay, beta, ref_states, slots, fresh, live, ref_snaps, snap_rows)
    # the reference equals one-token steps of the live rows, the snapshots the states between them
    step_states = states.clone()
    for j in range(n):
        idx = torch.tensor([i for i in (0, 1) if live[i, j]])
        o = delta_rule_decode_reference_(q[idx, j], k[idx, j], v[idx, j], decay[idx, j], beta[idx, j], step_states,
                                         slots[idx], fresh[idx])
        torch.testing.assert_close(want[idx, j], o, atol=1e-5, rtol=1e-5)
        if j < n - 1:
            torch.testing.assert_close(ref_snaps[snap_rows[idx, j]], step_states[slots[idx]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_states[slots[:2]], step_states[slots[:2]], atol=1e-5, rtol=1e-5)
    dev_states, dev_snaps = states.clone().to(device), snaps.clone().to(device)
    got = rows_(*(x.to(device) for x in (q, k, v, decay, beta)), dev_states, slots.to(device), fresh.to(device),
                live.to(device), dev_snaps, snap_rows.to(device))
    assert got.dtype == dtype and got.shape == (b, n, 4, 48)
    torch.testing.assert_close(got.cpu()[0], want[0], **_tol(dtype))
    torch.testing.assert_close(got.cpu()[1, :2], want[1, :2], **_tol(dtype))
    torch.testing.assert_close(dev_states.cpu()[[1, 2, 3, 4, 5]], ref_states[[1, 2, 3, 4, 5]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev_snaps.cpu()[1:5], ref_snaps[1:5], atol=1e-5, rtol=1e-5)


def check_conv_rows(device, dtype, rows_):
    """3 sequences x 3 rows through a 4-tap conv (slots 2, 4, and a fresh padding sequence on the
    scratch slot 0), the last row of sequence 1 dead; snapshots after rows 0 and 1."""
    g = torch.Generator().manual_seed(5)
    b, n, c = 3, 3, 200  # two channel blocks of the kernel
    x = torch.randn(b, n, c, generator=g).to(dtype)
    w = torch.randn(c, 1, 4, generator=g).to(dtype)
    states = torch.randn(6, c, 3, generator=g).to(dtype)
    slots, fresh = torch.tensor([2, 4, 0]), torch.tensor([False, False, True])
    live = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    snaps, snap_rows = torch.zeros(8, c, 3, dtype=dtype), torch.tensor([[1, 2], [3, 4], [0, 0]])
    ref_states, ref_snaps = states.clone(), snaps.clone()
    want = conv1d_decode_rows_reference_(x, w, ref_states, slots, fresh, live, "silu", ref_snaps, snap_rows)
    step_states = states.clone()  # against one-token steps of the live rows
    for j in range(n):
        idx = torch.tensor([i for i in (0, 1) if live[i, j]])
        y = conv1d_decode_reference_(x[idx, j], w, step_states, slots[idx], fresh[idx])
        torch.testing.assert_close(want[idx, j], y)
        if j < n - 1:
            torch.testing.assert_close(ref_snaps[snap_rows[idx, j]], step_states[slots[idx]])
    dev_states, dev_snaps = states.clone().to(device), snaps.clone().to(device)
    got = rows_(x.to(device), w.to(device), dev_states, slots.to(device), fresh.to(device), live.to(device), "silu",
                dev_snaps, snap_rows.to(device))
    assert got.dtype == dtype and got.shape == (b, n, c)
    torch.testing.assert_close(got.cpu()[0], want[0], **_tol(dtype))
    torch.testing.assert_close(got.cpu()[1, :2], want[1, :2], **_tol(dtype))
    torch.testing.assert_close(dev_states.cpu()[1:], ref_states[1:], **_tol(dtype))
    torch.testing.assert_close(dev_snaps.cpu()[1:5], ref_snaps[1:5], **_tol(dtype))


def _triton_checks(device):
    from qsaserve.ops.gdn import triton_decode as td

    for dtype in (torch.float32, torch.bfloat16):
        check_decode_ops(device, dtype, td.gdn_gates_triton, td.conv1d_decode_triton_, td.gated_rms_norm_triton)
        check_delta_rule(device, dtype, td.delta_rule_decode_triton_)
        check_delta_rule_rows(device, dtype, td.delta_rule_decode_rows_triton_)
        check_conv_rows(device, dtype, td.conv1d_decode_rows_triton_)


test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu = triton_check_tests(__file__, _triton_checks)
