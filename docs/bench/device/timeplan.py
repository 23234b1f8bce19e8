"""Time the phases of sections=auto planning, one line per count of the blocks, compile and dry step (the planner's
own summary line says the totals): `PYTHONPATH=. python docs/bench/device/timeplan.py <runner overrides>`.
Set TF_CPU_ALLOCATOR_USE_BFC=true TF_ENABLE_ONEDNN_OPTS=0 with TF_CPU_BFC_MEM_LIMIT_IN_MB yourself: this wrapper
imports TensorFlow before the runner can set them."""
import sys, time, functools, collections, runpy
T = collections.defaultdict(float); N = collections.Counter()
def wrap(mod, cls, name, label):
    owner = getattr(mod, cls) if cls else mod
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally:
            T[label] += time.perf_counter() - t; N[label] += 1
            print(f"[timeplan] {label} #{N[label]} {time.perf_counter()-t:.1f}s", file=sys.stderr, flush=True)
    setattr(owner, name, g)
import sections.step.engine as E, sections.step.executor as X
wrap(E, None, "static_blocks", "static_blocks")
wrap(E, None, "compile_schedule", "compile")
wrap(X, "Executor", "dry_step", "dry_step")
wrap(E, "Engine", "build", "build")
import atexit
atexit.register(lambda: print("[timeplan] TOTAL " + ", ".join(f"{k} {T[k]:.1f}s x{N[k]}" for k in T), file=sys.stderr))
sys.argv = ["runner"] + sys.argv[1:]
runpy.run_module("runner", run_name="__main__")
