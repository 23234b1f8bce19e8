"""Each dry step's runs on ResNet50 96x96 b256, sections=auto lean=recompute; usage: dry_runs_r50.py BUDGET_BYTES"""
import sys, time
sys.path.insert(0, "docs/bench/targets")
from sections import allocator
allocator.configure()
import frontier
from sections import Engine
from sections.step import engine as _engine
calls = []
cycle = _engine.Engine._cycle
def logged(self, batch, ready="keep"):
    out = cycle(self, batch, ready)
    calls.append(max(out[3].values()))
    return out
_engine.Engine._cycle = logged
dry = _engine.Engine._dry_step
def dlog(self, batch):
    calls.clear()
    r = dry(self, batch)
    print(f"DRY {self.schedule.num_sections} sections runs {[round(c / 2**20) for c in calls]} MiB -> {r[0] / 2**20:.0f}; "
          f"probe spread {self.section_probe.largest_spread() / 2**20:.1f} dry spread {self._dry_spread / 2**20:.1f}", flush=True)
    return r
_engine.Engine._dry_step = dlog
net, opt, data = frontier.build("ResNet50", 256)
e = Engine(net, opt, sections="auto", memory_budget=int(sys.argv[1]), lean="recompute", probe_batch=64)
try:
    e.build(data)
except ValueError as err:
    print("REFUSED", str(err)[:300])
    sys.exit()
print(e.replans)
calls.clear()
for _ in range(4):
    t = time.perf_counter(); s = e.train_step(data)
    print("step", round(s["step_peak_bytes"] / 2**20), f"{time.perf_counter() - t:.2f} s", flush=True)
