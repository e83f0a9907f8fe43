"""The Colab notebooks run top to bottom on CPU with small settings (SSD_JAX_SMALL=1), executed by
a real notebook runner (nbclient) in a fresh kernel of this interpreter, and are stored in git
without outputs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_inside_ssd.ipynb", "03_accelerators.ipynb"]
CELL_TIMEOUT = 600  # seconds; a cell compiling SmolLM2's SSD programs takes ~1-2 min on 2 cores


def _read(name: str):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _kernel_manager(tmp_path: Path) -> KernelManager:
    """A kernel on *this* interpreter: the stock `python3` spec runs whatever `python` is on
    PATH, which need not be the environment ssd_jax is installed in."""
    spec_dir = tmp_path / "kernels" / "ssd-jax-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ssd-jax test kernel", "language": "python"}))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return KernelManager(kernel_name="ssd-jax-test", kernel_spec_manager=ksm)


# 03 (35 s) runs in `make test-slow`: its fake-device meshes are test_mesh's by default.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("03")
                                  else n for n in NAMES])
def test_notebook_runs_with_small_settings(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_JAX_SMALL", "1")
    # The kernel compiles at the tests' level (conftest: notebook 02 took 46 s at level 0,
    # 59 s at XLA's default) and nothing else: notebook 03 appends its own device count.
    monkeypatch.setenv("XLA_FLAGS", " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization_level" in f))
    nb = _read(name)
    km = _kernel_manager(tmp_path)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute()  # raises CellExecutionError, with the failing cell and traceback
    finally:
        # nbclient shuts down only kernels it made itself: ours would live on (holding a
        # model, ~1 GB, and a few percent of a core each) for the rest of the test run.
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        # Its client too: left to the garbage collector, it logs to a closed stream at the
        # end of the pytest worker ("Could not destroy zmq context").
        if client.kc is not None:
            client.kc.stop_channels()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    # Every plot the notebook draws was rendered (an image output), not silently skipped.
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
    plots = sum(c.source.count("plt.show()") for c in nb.cells if c.cell_type == "code")
    assert images >= plots


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None
             or "execution" in c.metadata]
    assert not dirty, f"{name}: code cells {dirty} have outputs; clear them before committing"
    assert "widgets" not in nb.metadata
    # The first code cell is the small-settings switch CI relies on.
    assert "SSD_JAX_SMALL" in code[0].source


def test_accelerator_notebook_sets_device_count_before_jax():
    first = next(c for c in _read("03_accelerators.ipynb").cells if c.cell_type == "code").source
    assert "--xla_force_host_platform_device_count=4" in first
    assert "import jax" not in first and "from jax" not in first  # JAX reads the flag at start
