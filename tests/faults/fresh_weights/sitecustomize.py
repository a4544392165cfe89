"""A fault for ``libra-ctl verify-resume``: a restore that loads the run's initial weights.

Put on a run's ``PYTHONPATH`` (``tests/test_verify_resume.py``), it wraps
``workers.update.load_policy`` in every process that imports it: asked for a
checkpoint's ``model`` directory, it loads the run's initial policy instead. The
learner still restores the checkpoint's step, counters, optimizer and version
line from ``state.json``: only the weights go back to the start, which the step,
version and (in a short run) level checks cannot see.
"""

import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path


class _InitialWeights(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "workers.update":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            load_policy = module.load_policy

            def initial_instead(model_dir, *args, **kwargs):
                d = Path(model_dir)
                if d.name == "model" and d.parent.name.startswith("step-"):   # runs/<id>/checkpoints/step-N/model
                    manifest = json.loads((d.parent.parent.parent / "manifest.json").read_text())
                    d = Path(manifest["initial_policy"])
                return load_policy(d, *args, **kwargs)

            module.load_policy = initial_instead

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _InitialWeights())
