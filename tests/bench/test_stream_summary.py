"""The bench's stream summary splits a profiled step's time by what the
copy engines did, and says when in the step they idled."""

from tierd.bench.attach_step import stream_summary


def _event(name, cat, ts_us, dur_us, stream=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us,
            "args": {"stream": stream}}


def test_compute_idle_time_is_split_by_the_copy_running_and_placed_in_the_step():
    # compute busy 0-100 ms and 300-400 ms; a copy in 100-250 ms (the
    # compute waits for it), a copy out 250-300 ms; the backward's first
    # loss-gradient kernel at 300 ms
    trace = {"traceEvents": [
        _event("gemm", "kernel", 0, 100_000),
        _event("nll_loss_backward_reduce_cuda_kernel_2d", "kernel", 300_000, 10_000),
        _event("gemm", "kernel", 310_000, 90_000),
        _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 100_000, 150_000, stream=9),
        _event("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 250_000, 50_000, stream=11),
        _event("short", "kernel", 0, 1, stream=13),
    ]}
    out = stream_summary(trace, slices=4)
    assert abs(out["window_s"] - 0.4) < 1e-9 and abs(out["compute_busy_s"] - 0.2) < 1e-9
    assert abs(out["idle_h2d_s"] - 0.15) < 1e-9 and abs(out["idle_d2h_s"] - 0.05) < 1e-9
    assert out["idle_none_s"] < 1e-9
    # [compute, h2d, d2h] in each tenth of a second
    assert out["timeline"] == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]
    assert out["backward_at"] == 0.75


def test_a_trace_without_a_loss_gradient_has_no_backward_mark():
    trace = {"traceEvents": [_event("gemm", "kernel", 0, 1_000)]}
    assert stream_summary(trace, slices=2)["backward_at"] is None
