"""The GPU branch of ``sections.backend.device`` on a real card, where TensorFlow is not installed.

The lent GPU machine has no TensorFlow (nor room to carry it: its wheel and CUDA libraries are far over the 64 MiB a
call may carry), so this loads ``sections/backend/device.py`` with a stand-in ``tensorflow`` that reports one GPU and
checks what needs no TensorFlow: the card's memory as ``nvidia-smi`` gives it, the budget resolved from it (None,
a fraction) and a memory limit set on the logical device taking precedence.
    PYTHONPATH=. python3 docs/bench/gpu/card_memory_check.py
"""

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def package(name, path):
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Config:
    limits = []

    @staticmethod
    def list_physical_devices(kind):
        return ["/physical_device:GPU:0"] if kind == "GPU" else ["/physical_device:CPU:0"]

    @classmethod
    def get_logical_device_configuration(cls, gpu):
        return [types.SimpleNamespace(memory_limit=m) for m in cls.limits]


sys.modules["tensorflow"] = types.SimpleNamespace(config=Config)
package("sections", ROOT / "sections")
package("sections.schedule", ROOT / "sections" / "schedule")
package("sections.backend", ROOT / "sections" / "backend")
load("sections.schedule.policies", ROOT / "sections/schedule/policies.py")
load("sections.rules", ROOT / "sections/rules.py")
load("sections.allocator", ROOT / "sections/allocator.py")
device = load("sections.backend.device", ROOT / "sections/backend/device.py")

try:
    raw = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv"],
                         capture_output=True, text=True)
    print("nvidia-smi:", raw.stdout.strip() or raw.stderr.strip())
except OSError as err:
    print("nvidia-smi:", err)
memory = device.device_memory("GPU:0")
print("device_memory:", memory.describe(), "hard" if memory.hard else "soft")
if memory.total is not None:
    for value in (None, 0.8, "2GiB"):
        print(f"budget {value!r}:", device.resolve_budget(value, memory))
Config.limits = [4096]
print("with a 4096 MiB logical-device limit:", device.device_memory("GPU:0").describe())
