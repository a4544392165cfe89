"""Test-only fault: learner checkpoints that skip their offsets (tests/test_verify_resume.py).

Put this directory first on the PYTHONPATH of a run and every Python process
of it imports this module at start-up (``site`` imports ``sitecustomize``).
It does nothing until ``workers.checkpoint`` is imported (the learner); then
it wraps ``write_checkpoint`` so that each checkpoint leaves the ids of its
first group out of ``consumed.txt``. The learner acknowledges the step's
entries all the same, so that group is lost: acknowledged, recorded nowhere.
No switch in the product turns this on.
"""

import importlib.abc
import importlib.machinery
import sys

TARGET = "workers.checkpoint"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _skip_first_group(module)

        spec.loader.exec_module = exec_module
        return spec


def _skip_first_group(module) -> None:
    write = module.write_checkpoint

    def write_skipping(ckpt_dir, model, optimizer, consumed, *args, **kwargs):
        first = consumed[0].rsplit("/", 1)[0] if consumed else None
        kept = [i for i in consumed if i.rsplit("/", 1)[0] != first]
        return write(ckpt_dir, model, optimizer, kept, *args, **kwargs)

    module.write_checkpoint = write_skipping


sys.meta_path.insert(0, _PatchOnImport())
