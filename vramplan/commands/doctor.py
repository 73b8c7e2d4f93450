"""`vramplan doctor`: this machine's libraries against the versions the estimates model, the
version boundaries that change memory, and the GPU, driver and CUDA build. Torch-free (versions
come from package metadata, torch's CUDA build from its version.py read as text); always exit 0."""

from __future__ import annotations

import platform
import sys

import click

from .options import print_json, user_errors, warn


def _gather() -> dict:
    from .. import __version__
    from ..util.machine import local_gpu_names, local_ram_bytes, nvidia_driver_version, torch_cuda_version
    from ..util.versions import LIBRARIES, MODELLED, boundaries_crossed, drift, library_versions

    names = list(dict.fromkeys([*MODELLED, *LIBRARIES]))
    installed = library_versions(names)
    crossed = boundaries_crossed(installed)
    return {
        "vramplan": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "libraries": [{"name": n, "installed": installed[n], "modelled": MODELLED.get(n)} for n in names],
        "drift": drift(installed),
        "boundaries_crossed": [{"library": b.library, "installed": have, "boundary": ".".join(map(str, b.below)),
                                "installed_side": b.before if b.side(have) == "before" else b.after,
                                "modelled_side": b.after if b.side(have) == "before" else b.before,
                                "source": b.source} for b, have in crossed],
        "torch_cuda": torch_cuda_version() if installed.get("torch") else None,
        "gpus": list(local_gpu_names()),
        "driver": nvidia_driver_version(),
        "host_ram_bytes": local_ram_bytes(),
    }


def _boundary_lines() -> list[str]:
    from ..util.versions import BOUNDARIES, MODELLED

    out = []
    for b in BOUNDARIES:
        at = ".".join(map(str, b.below))
        since = f"{'.'.join(map(str, b.since))} to {at}" if b.since else f"before {at}"
        modelled = "from " + at if b.side(MODELLED.get(b.library, "")) == "after" else since
        out += [f"  {b.library} {at} (the estimate models {b.library} {modelled}; {b.source})",
                f"    {since}: {b.before}", f"    from {at}: {b.after}"]
    return out


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
def doctor(as_json: bool) -> None:
    """Installed library versions against the ones the estimates model, the version boundaries
    that change memory, and this machine's GPU, driver and CUDA build. Exits 0; a warning line
    says where the versions drift."""
    from ..util.units import gib

    info = _gather()
    if as_json:
        print_json(info)
    else:
        click.echo(f"vramplan {info['vramplan']} · python {info['python']} · {info['platform']}")
        click.echo(f"{'library':<14} {'installed':<16} {'modelled':<10}")
        for lib in info["libraries"]:
            have, want = lib["installed"], lib["modelled"]
            if want is None:
                state = "recorded with measurements"
            elif have is None:
                state = "not installed (estimate, plan, emit and check need none of it)"
            elif lib["name"] in info["drift"]:
                state = "differs"
            else:
                state = "ok"
            click.echo(f"{lib['name']:<14} {have or '-':<16} {want or '-':<10} {state}")
        click.echo("version boundaries that change memory (vramplan.util.versions.BOUNDARIES):")
        for line in _boundary_lines():
            click.echo(line)
        for b in info["boundaries_crossed"]:
            click.echo(f"  crossed: {b['library']} {b['installed']} installed is on the other side of "
                       f"{b['boundary']}: {b['installed_side']}")
        torch_build = ("-" if info["torch_cuda"] is None and not any(
            lib["name"] == "torch" and lib["installed"] for lib in info["libraries"])
            else ("CPU build" if info["torch_cuda"] is None else f"CUDA {info['torch_cuda'] or '?'}"))
        click.echo(f"torch build: {torch_build}")
        if info["gpus"]:
            click.echo(f"GPUs: {', '.join(info['gpus'])} · driver {info['driver'] or 'unknown'}")
        else:
            click.echo("GPUs: none found (no /proc/driver/nvidia, no nvidia-smi answer)")
        if info["host_ram_bytes"]:
            click.echo(f"host RAM: {gib(info['host_ram_bytes'])} GiB")
    for why in info["drift"].values():
        warn(f"{why}: this machine's step may allocate differently from the estimate "
             f"(pip install -c constraints.txt pins the modelled versions)")
    sys.stdout.flush()
