"""The replay's hot modules run from their Cython builds (serving_integration/compiled.py), only while
a build is of the source as it is now, and give the numbers the interpreted modules give."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types

import pytest

from serving_integration import compiled
from tests.simulator.test_replay_golden import CASES, replay

INTERPRETED = os.environ.get(compiled.SWITCH) == "0"


def summaries() -> str:
    """Every golden case replayed whole (the bounds included: bound.py is compiled too), as JSON."""
    return json.dumps({name: replay(name, whole=True) for name in CASES}, sort_keys=True)


@pytest.mark.skipif(INTERPRETED, reason=f"{compiled.SWITCH}=0: the modules run interpreted")
def test_the_hot_modules_run_from_their_builds_of_the_current_source():
    for name in compiled.MODULES:
        module = importlib.import_module(name)
        built = compiled.compiled_path(name)
        assert built is not None, f"{name}: no build of its current source (make setup builds it)"
        assert module.__file__ == str(built), f"{name} runs from {module.__file__}"
    assert compiled.loaded() == list(compiled.MODULES)


def test_an_edited_source_is_not_served_an_older_build(tmp_path, monkeypatch):
    name = "serving_integration.simulator.engine"
    source = compiled.source_file(name).read_bytes()
    assert compiled.compiled_path(name, source + b"\n# edited\n") is None
    declared = "serving_integration.simulator.radix"  # its build reads radix.pxd too, so its name does
    assert compiled.declarations(declared), "radix.pxd"
    assert compiled.compiled_path(declared, declared=compiled.declarations(declared) + b"\n# edited\n") is None
    # engine.pxd cimports the workload's declarations: its build is of workload.py as it is now too
    assert compiled.cimported(compiled.declarations(name)) == ["serving_integration.cache.workload",
                                                                "serving_integration.simulator.radix"]
    workload, source_file = "serving_integration.cache.workload", compiled.source_file
    edited = tmp_path / "workload.py"
    edited.write_bytes(source_file(workload).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(compiled, "source_file", lambda module: edited if module == workload else source_file(module))
    assert compiled.compiled_path(name) is None
    monkeypatch.undo()
    finder = compiled.CompiledFinder()
    assert finder.find_spec("serving_integration.simulator.config") is None  # not a compiled module
    if not INTERPRETED:
        assert finder.find_spec(name).origin == str(compiled.compiled_path(name))


def test_a_cimport_cycle_names_a_build_and_an_edit_anywhere_in_it_renames_it(tmp_path, monkeypatch):
    """Declarations that cimport each other (radix's cimporting the engine's, which cimport radix's):
    the digest reads each module once and ends; an edited module anywhere in the cycle renames the
    builds of both."""
    engine, radix = "serving_integration.simulator.engine", "serving_integration.simulator.radix"
    declarations, source_file = compiled.declarations, compiled.source_file

    def cycle(module: str) -> bytes:
        return declarations(module) + (f"\nfrom {engine} cimport Server\n".encode() if module == radix else b"")

    monkeypatch.setattr(compiled, "declarations", cycle)
    assert engine in compiled.upstream(radix) and radix in compiled.upstream(engine)
    before = {name: compiled.digest(source_file(name).read_bytes(), cycle(name)) for name in (engine, radix)}
    edited = tmp_path / "engine.py"
    edited.write_bytes(source_file(engine).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(compiled, "source_file", lambda module: edited if module == engine else source_file(module))
    assert compiled.digest(source_file(radix).read_bytes(), cycle(radix)) != before[radix]
    assert compiled.digest(edited.read_bytes(), cycle(engine)) != before[engine]


@pytest.mark.skipif(INTERPRETED, reason=f"{compiled.SWITCH}=0: the modules run interpreted")
def test_the_declared_classes_are_extension_types_in_the_builds():
    """The .pxd declarations took effect: a declared field is the extension type's own (a getset
    descriptor), not a __slots__ member, and an undeclared one cannot be set."""
    from serving_integration.cache import policies, trust, workload
    from serving_integration.simulator import engine, radix

    for cls, field in ((radix.Node, "lock_ref"), (trust.ShadowEntry, "stamp"), (trust.TimeShadowEntry, "queued"),
                       (trust.ShadowCache, "used"), (trust.ShadowCache, "order"),
                       (trust.OutcomeTrust, "entries"), (trust.TimeOutcomeTrust, "queued_keys"),
                       (engine.Server, "waiting"), (engine.Request, "prefill_left"), (engine.Counters, "ttfts"),
                       (radix.RadixTree, "gpu_used"), (workload.SimCall, "lens"), (workload.SimWorkflow, "next_call"),
                       (policies.WorkflowLedger, "users"), (policies._WorkflowRows, "part")):
        assert isinstance(getattr(cls, field), types.GetSetDescriptorType), f"{cls.__name__}.{field}"
    with pytest.raises(AttributeError):
        radix.Node(1, None, (7,), (3,)).undeclared = 1
    call = workload.SimCall("coder", (1,), (3,), (5,), "out", 2, 0.0, None)
    with pytest.raises(AttributeError):  # a call stays frozen as an extension type
        call.agent = "tester"


@pytest.mark.skipif(INTERPRETED, reason=f"{compiled.SWITCH}=0: nothing compiled to compare")
def test_compiled_and_interpreted_replays_give_the_same_summaries():
    """Every golden replay's whole summary (latencies, hits, the three bounds), compiled in this
    process and interpreted in another, equal to the last bit."""
    env = {**os.environ, compiled.SWITCH: "0"}
    script = ("import sys; from serving_integration import compiled; "
              "from serving_integration.simulator import engine; assert not compiled.loaded(); "
              "from tests.simulator.test_compiled import summaries; sys.stdout.write(summaries())")
    interpreted = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                 check=True, cwd=compiled.ROOT).stdout
    assert json.loads(summaries()) == json.loads(interpreted)


def test_a_traceback_through_a_compiled_module_shows_its_source_lines():
    import traceback

    from serving_integration.cache.workload import workflows_from_rows

    with pytest.raises(KeyError) as raised:
        workflows_from_rows([{"not a field": 1}])
    text = "".join(traceback.format_exception(raised.value))
    assert 'workflows.get(row["workflow_id"])' in text, text
