"""``python -m tilegemm run MODEL``: load a network, time it, profile it, compare it.

    python -m tilegemm run MODEL.onnx | resnet18 | mobilenet_v2 | vgg11
        [--batch N] [--threads T] [--input-shape 1,3,224,224] [--repeats R]
        [--profile] [--dump plan.json] [--no-compare] [--save MODEL.onnx]
        [--no-layout-transform] [--both-plans] [--scaling] [--int8]

A built-in name builds that model with random weights (:mod:`tilegemm.tools.zoo`).
Latency is the best and the median of ``--repeats`` runs, alternating with each peer
(onnxruntime on the same model, torch on the same optimized graph, when installed)
so that a busy machine weighs on all alike.  ``--int8`` first quantizes the model
(QDQ, :mod:`tilegemm.tools.qmodel`) and runs that.  Exit status 0, 1 when an output
differs from onnxruntime's beyond 1e-4 relative (a quantized model: 0.1, a few
quantization steps: see :data:`QUANTIZED_TOLERANCE`), 2 for bad options or models.
"""
import argparse
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

#: Relative difference from onnxruntime's output that counts as wrong.
TOLERANCE = 1e-4
#: The same for a quantized model: a code rounded the other way in one layer (exact
#: int32 sums here; onnxruntime's AVX2 kernels saturate 16-bit pair sums) moves the
#: next layers' codes, so outputs differ by a few quantization steps, not by 1e-4.
QUANTIZED_TOLERANCE = 0.1


def build_parser():
    p = argparse.ArgumentParser(prog="tilegemm run",
                                description="Run an ONNX model on tilegemm: latency, per-op "
                                            "profile, and a comparison with onnxruntime/torch.")
    p.add_argument("model", help="an .onnx file, or a built-in model with random weights: "
                                 "resnet18, mobilenet_v2, vgg11")
    p.add_argument("--batch", type=int, default=1, help="batch size for a symbolic batch (1)")
    p.add_argument("--threads", type=int, default=None, help="threads (default: tilegemm's)")
    p.add_argument("--input-shape", default=None,
                   help="the whole input shape, e.g. 1,3,224,224 (overrides --batch)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per party (10)")
    p.add_argument("--profile", action="store_true",
                   help="per-op table: node, op, fused ops, layout, algorithm, ms, %%, GFLOPS")
    p.add_argument("--dump", metavar="PLAN.json", help="write the executed plan as JSON")
    p.add_argument("--no-compare", action="store_true", help="time tilegemm alone")
    p.add_argument("--save", metavar="MODEL.onnx", help="write the (built-in) model to a file")
    p.add_argument("--no-layout-transform", action="store_true",
                   help="run every step NCHW (no layout plan)")
    p.add_argument("--both-plans", action="store_true",
                   help="also time the single-layout plans (all NCHW; NHWC wherever a step "
                        "can) beside the layout DP's, in the same rounds")
    p.add_argument("--int8", action="store_true",
                   help="quantize the model first (onnxruntime's quantize_static, QDQ: uint8 "
                        "activations, int8 weights per channel, calibrated on random inputs) "
                        "and run that")
    p.add_argument("--reduce-range", action="store_true",
                   help="with --int8: 7-bit weights (quantize_static's reduce_range, its advice "
                        "for hosts without VNNI), which AVX2's vpmaddubsw sums exactly")
    p.add_argument("--scaling", action="store_true",
                   help="also time tilegemm on one thread (its own plan) in the same rounds, "
                        "and print the throughput ratio")
    return p


def load(name):
    """``(ModelProto, serialized bytes)`` of a file or a built-in model."""
    import onnx

    from tilegemm.tools.zoo import MODELS
    if name in MODELS:
        proto = MODELS[name][0]()
        return proto, proto.SerializeToString()
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no such model file: {name!r} (built-in models: "
                                f"{', '.join(sorted(MODELS))})")
    with open(name, "rb") as f:
        data = f.read()
    return onnx.load_model_from_string(data), data


def input_shape(net, batch, given):
    """The concrete input shape: ``--input-shape``, else the model's with ``batch`` for
    a symbolic first dimension."""
    if given:
        return tuple(int(v) for v in given.split(","))
    info = net.inputs[0]
    shape = [d if isinstance(d, int) and d > 0 else None for d in info.shape]
    if shape and shape[0] is None:
        shape[0] = batch
    if None in shape:
        raise ValueError(f"input {info.name!r} has symbolic dimensions {info.shape}; "
                         "give --input-shape")
    return tuple(shape)


def _peers(args, data, net, threads):
    from tilegemm.tools.peers import Unavailable, onnxruntime_peer, torch_peer
    peers, notes = [], []
    if args.no_compare:
        return peers, notes
    for make in (lambda: onnxruntime_peer(data, net.inputs[0].name, threads),
                 lambda: torch_peer(net.graph, threads)):
        try:
            peers.append(make())
        except Unavailable as why:
            notes.append(str(why))
    return peers, notes


def _one_thread(proto, net, x):
    """tilegemm limited to one thread, with the plan it makes on one thread."""
    import tilegemm
    with tilegemm.thread_limit(1):
        one = tilegemm.load_onnx(proto, layout_transform=net.layout_transform)
        one(x)

    def run(x):
        with tilegemm.thread_limit(1):
            return one(x)
    return run


def _time(parties, x, repeats, threads=1):
    """``{name: [seconds, ...]}``: the parties in turn, ``repeats`` rounds.

    With several threads each sample waits for the previous party's idle workers to
    stop spinning and warms up as the GEMM benchmark's do (``timing.before_sample``):
    ResNet-18 and MobileNetV2 at batch 8 on 2 threads ran 1.2-1.4x slower right
    after torch's or onnxruntime's call than after a pause."""
    from tilegemm.tools.timing import before_sample, ramp_time, settle_time
    times = {name: [] for name, _ in parties}
    for _ in range(repeats):
        for name, call in parties:
            before_sample(lambda: call(x), settle_time(threads), ramp_time(threads))
            t0 = time.perf_counter()
            call(x)
            times[name].append(time.perf_counter() - t0)
    return times


def profile_rows(net, x, repeats):
    """Per step: (node, seconds (best of ``repeats``), layout, algorithm, flops)."""
    best = {}
    for _ in range(repeats):
        entries = []
        net.run({net.inputs[0].name: x}, profile=entries)
        for i, entry in enumerate(entries):
            if i not in best or entry[1] < best[i][1]:
                best[i] = entry
    return [(node, seconds, layout) + tuple(net.describe(node, shapes, layout, choice))
            for node, seconds, shapes, layout, choice in best.values()]


def profile_table(rows):
    total = sum(r[1] for r in rows) or 1.0
    lines = [f"{'node':<24} {'op':<18} {'fused':<28} {'layout':<6} {'algorithm':<22} "
             f"{'ms':>8} {'%':>6} {'GFLOPS':>7}"]
    for node, seconds, layout, algorithm, flops in rows:
        gflops = f"{flops / seconds / 1e9:7.1f}" if flops and seconds else ""
        lines.append(f"{node.name[:24]:<24} {node.op:<18} {'+'.join(node.fused)[:28]:<28} "
                     f"{layout:<6} {algorithm[:22]:<22} {seconds * 1e3:8.3f} "
                     f"{100 * seconds / total:6.1f} {gflops:>7}")
    return "\n".join(lines)


def plan_json(rows):
    return [dict(node=n.name, op=n.op, fused=n.fused, epilogue=n.epilogue, inputs=n.inputs,
                 outputs=n.outputs, layout=layout, algorithm=algorithm, flops=int(flops),
                 ms=round(seconds * 1e3, 4)) for n, seconds, layout, algorithm, flops in rows]


def _compare(peers, x, ours, proto):
    """Print each peer's largest difference from ``ours`` (and the top-1 agreement of a
    classifier); 1 when onnxruntime's is past the tolerance, else 0."""
    from tilegemm.tools.qmodel import is_quantized
    tolerance = QUANTIZED_TOLERANCE if is_quantized(proto) else TOLERANCE
    status = 0
    for peer in peers:
        out = peer(x)
        diff = float(np.max(np.abs(out - ours)) / max(np.max(np.abs(out)), 1e-30))
        agree = ""
        if out.ndim == 2 and out.shape[1] > 1:
            top = np.mean(np.argmax(out, axis=1) == np.argmax(ours, axis=1))
            agree = f"; the same top-1 class in {top:.0%} of the batch"
        print(f"max |tilegemm - {peer.name}| / max |{peer.name}| = {diff:.1e}{agree}")
        status = 1 if peer.name == "onnxruntime" and not diff <= tolerance else status
    return status


def run(args):
    import tilegemm
    from tilegemm.tools.report import machine_info
    if args.threads:
        tilegemm.set_num_threads(args.threads)
    threads = tilegemm.get_num_threads()
    proto, data = load(args.model)
    if args.int8:
        from tilegemm.tools.qmodel import quantize_model
        plain = tilegemm.load_onnx(proto, layout_transform=False)
        proto = quantize_model(proto, input_shape(plain, args.batch, args.input_shape),
                               reduce_range=args.reduce_range)
        data = proto.SerializeToString()
    if args.save:
        with open(args.save, "wb") as f:
            f.write(data)
    t0 = time.perf_counter()
    net = tilegemm.load_onnx(proto, layout_transform=not args.no_layout_transform)
    load_s = time.perf_counter() - t0
    x = np.random.default_rng(0).standard_normal(input_shape(net, args.batch, args.input_shape))
    x = x.astype(net.inputs[0].dtype)
    plan_s = 0.0
    if net.layout_transform:
        t0 = time.perf_counter()
        plan = net.plan({net.inputs[0].name: x})
        plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = net(x)
    first_s = time.perf_counter() - t0
    net(x)                             # the run on reused buffers that later runs replay
    tracemalloc.start()
    net(x)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    info = machine_info(measure_peak=False)
    print(f"{args.model}: input {x.shape} {x.dtype}, {threads} thread(s), {info['brand']} "
          f"({info['isa']})")
    print(f"load {load_s:.2f} s, layout plan {plan_s:.2f} s, first run {first_s:.2f} s, "
          f"a steady-state run allocates {peak / 2 ** 10:.0f} KiB at most (numpy, "
          f"outputs included)")
    if net.layout_transform:
        counts = {layout: plan.layouts.count(layout) for layout in sorted(set(plan.layouts))}
        print(f"layout plan: steps per layout {counts}; predicted {plan.seconds * 1e3:.2f} ms, "
              f"all NCHW {plan.nchw_seconds * 1e3:.2f} ms, NHWC where possible "
              f"{plan.nhwc_seconds * 1e3:.2f} ms (sums of the steps' timed costs)")
        whole = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in plan.measured.items())
        print(f"whole runs at planning: {whole}; running the {plan.name} plan")
    peers, notes = _peers(args, data, net, threads)
    status = _compare(peers, x, ours, proto)
    parties = [("tilegemm", net)]
    if args.both_plans and net.layout_transform:
        for layout in ("NCHW", "NHWC"):
            single = tilegemm.load_onnx(proto)
            single.plan({net.inputs[0].name: x}, plan.single(layout))
            single(x)
            parties.append((f"tilegemm {layout}", single))
    if args.scaling and threads > 1:
        parties.append(("tilegemm 1 thread", _one_thread(proto, net, x)))
    times = _time(parties + [(p.name, p) for p in peers], x, args.repeats, threads)
    best_ours = min(times["tilegemm"])
    for name, ts in times.items():
        ratio = "" if name == "tilegemm" else f"  {min(ts) / best_ours:.2f}x tilegemm's time"
        print(f"{name:<14} best {min(ts) * 1e3:9.2f} ms  median {statistics.median(ts) * 1e3:9.2f}"
              f" ms{ratio}")
    if "tilegemm 1 thread" in times:
        print(f"{threads} threads give {min(times['tilegemm 1 thread']) / best_ours:.2f}x the "
              f"one-thread throughput (best times; medians "
              f"{statistics.median(times['tilegemm 1 thread']) / statistics.median(times['tilegemm']):.2f}x)")
    for note in notes:
        print(f"(not compared: {note})")
    if args.profile or args.dump:
        rows = profile_rows(net, x, max(3, args.repeats // 2))
        if args.profile:
            print(profile_table(rows))
        if args.dump:
            with open(args.dump, "w") as f:
                json.dump(plan_json(rows), f, indent=1)
    return status


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        print("tilegemm run: --batch, --repeats and --threads must be positive", file=sys.stderr)
        return 2
    try:
        return run(args)
    except (FileNotFoundError, ValueError, NotImplementedError, ImportError) as err:
        print(f"tilegemm run: {err}", file=sys.stderr)
        return 2
