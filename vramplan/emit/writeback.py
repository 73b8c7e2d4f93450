"""``vramplan plan --from FILE --emit DIR``: the user's own config written back with only the fields
the plan changes changed, each with a comment saying why.

The edit is line-level, guided by the line and column marks of the YAML's composed nodes
(:func:`vramplan.setup.inputs.compose_yaml`), so the user's comments, key order and every other field
stay byte for byte: a changed scalar is replaced in place and gets ``# vramplan: was OLD; ...`` at
the end of its line; a key the plan's setup no longer has is commented out; a key the file lacks
is added (at the end of its parent block, or of the file). Which keys carry which Setup field is
each writer's ``FIELD_KEYS`` (:mod:`vramplan.emit.hf_configs`, :mod:`vramplan.emit.torchtune`);
the new values are those the writer emits for the plan's setup. JSON (HF ``TrainingArguments``)
cannot carry comments: its keys are rewritten in order and the reasons go to ``vramplan-changes.md``,
which every write-back has. The why is built from the typed :class:`~vramplan.readers.Change`
objects and the two Breakdowns (as written, planned).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..specs import Breakdown, ModelSpec, Plan, Setup, SpecError
from ..util.units import gib
from .common import ACCELERATE_CONFIG, DS_CONFIG, one_line

__all__ = ["CHANGES_FILE", "Edit", "write_back"]

CHANGES_FILE = "vramplan-changes.md"
_ABSENT = object()

#: HF TrainingArguments (+ the script arguments read_hf reads): the TRL writer's keys for these fields
_HF_KEYS = {"optimizer": ("optim",), "checkpointing": ("gradient_checkpointing", "activation_checkpointing"),
            "batch": ("per_device_train_batch_size",), "grad_accum": ("gradient_accumulation_steps",),
            "attn": ("attn_implementation",), "zero_stage": ("deepspeed",), "offload_optimizer": ("deepspeed",),
            "offload_params": ("deepspeed",), "liger": ("use_liger_kernel",), "fsdp": ("fsdp", "fsdp_config")}
#: fields the accelerate config carries for these formats (written into DIR when they change)
_ACCELERATE_FIELDS = {"axolotl": {"gpus"}, "llamafactory": {"gpus", "fsdp"}, "trl": {"gpus", "fsdp"},
                      "hf": {"gpus", "fsdp"}}
#: the file's own choices the plan's search does not plan yet: a plan without them is not the
#: user's run with savers added, so it is not written back over them
_UNPLANNED = ("dora", "modules_to_save", "padding_free")
#: fields whose change needs another recipe in torchtune (its ``tune run`` line): not a line edit
_TORCHTUNE_RECIPE = {"method", "quant", "fsdp", "gpus", "zero_stage", "offload_optimizer"}


@dataclass(frozen=True)
class Edit:
    """One key of the file set to ``value`` (``None`` with ``remove``: commented out), for ``why``."""

    key: str
    value: object
    remove: bool
    why: str


def _flow(value) -> str:
    """``value`` as one line of YAML flow text (a scalar, ``[a, b]``, ``{k: v}``)."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**9, allow_unicode=True).strip()[1:-1]


def _get(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _leaves(key: str, value) -> list[tuple[str, object]]:
    """A dict value as its nested keys (edited one by one, so the user's block keeps its lines)."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [(key, value)]


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _setup_line(c) -> str:
    return f"{c.field} {_shown(c.file)} -> {_shown(c.plan)}"


def reason(change, plan: Plan, as_written: Breakdown) -> str:
    """Why the plan changes this field, from the typed data: the change, the global batch it keeps,
    the two estimates."""
    s = plan.setup
    what = _setup_line(change)
    if change.field in ("batch", "grad_accum"):
        gpus = f" x {s.gpus} GPUs" if s.gpus > 1 else ""
        what += f" (micro-batch {s.batch} x grad accum {s.grad_accum}{gpus} keeps the global batch " \
                f"{s.batch * s.grad_accum * s.gpus})"
    usable = as_written.gpu.usable_memory_bytes if as_written.gpu else None
    fit = ("does not fit" if not as_written.fits else "fits") if usable else ""
    verdict = f"as written {gib(as_written.device_total_bytes)} GiB"
    if usable:
        verdict += f" {fit} {gib(usable)} GiB usable"
    verdict += f"; plan {gib(plan.breakdown.device_total_bytes)} GiB"
    if plan.tokens_per_s:
        verdict += f", ~{plan.tokens_per_s:,.0f} tokens/s" + (" (the fastest that fits)" if as_written.fits else "")
    return f"{what}; {verdict}"


def _edits(fmt: str, changes, plan: Plan, as_written: Breakdown, target: dict) -> list[Edit]:
    from .hf_configs import FIELD_KEYS
    from .torchtune import FIELD_KEYS as TT_KEYS

    table = {**FIELD_KEYS, "torchtune": TT_KEYS, "hf": _HF_KEYS}[fmt]
    edits: dict[str, Edit] = {}
    for c in changes:
        if c.field in _UNPLANNED and c.file and not c.plan:
            raise SpecError(f"cannot write the plan back into this {fmt} config: the plan drops its "
                            f"{_setup_line(c)} (the search does not plan {c.field} yet)")
        if c.field in _ACCELERATE_FIELDS.get(fmt, ()) and c.field not in table:
            continue  # the accelerate config written beside the file carries it
        if fmt == "torchtune" and c.field in _TORCHTUNE_RECIPE:
            raise SpecError(f"cannot write the plan back into a torchtune config: it changes {_setup_line(c)}, "
                            "which is another recipe (the tune run line); write one with "
                            "vramplan emit PLAN --format torchtune")
        keys = table.get(c.field)
        if keys is None:
            raise SpecError(f"cannot write the plan back into a {fmt} config: it changes {_setup_line(c)}, "
                            f"which vramplan does not map to a {fmt} field")
        why = reason(c, plan, as_written)
        for key in keys:
            value = _get(target, key)
            for leaf, leaf_value in _leaves(key, value) if value is not _ABSENT else [(key, value)]:
                if leaf not in edits:
                    edits[leaf] = Edit(leaf, None if leaf_value is _ABSENT else leaf_value, leaf_value is _ABSENT, why)
    return list(edits.values())


def _end(node):
    """The mark after a node's last character (a block collection's own end mark is the next token's)."""
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and not node.flow_style and node.value:
        last = node.value[-1]
        return _end(last[1] if isinstance(last, tuple) else last)
    return node.end_mark


def _find(root, key: str):
    """(parent mapping node, key node, value node) for a dotted key; key/value None when absent
    (parent None when a parent is absent or not a mapping)."""
    node, parts = root, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, yaml.MappingNode):
            return None, None, None
        hit = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        if hit is None:
            return (node, None, None) if i == len(parts) - 1 else (None, None, None)
        if i == len(parts) - 1:
            return node, hit[0], hit[1]
        node = hit[1]
    return None, None, None


def edit_yaml(text: str, edits: list[Edit], where: str) -> str:
    """``text`` with ``edits`` applied line by line; everything else kept."""
    from ..setup.inputs import compose_yaml

    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    appended: list[str] = []
    inserts: dict[int, list[str]] = {}  # line index -> lines to insert before it
    replaced: dict[int, str] = {}
    root = compose_yaml(text, where)
    if not isinstance(root, yaml.MappingNode):
        raise SpecError(f"{where}: not a mapping of fields")
    for e in edits:
        note = f"  # vramplan: {one_line(e.why)}\n"
        parent, knode, vnode = _find(root, e.key)
        leaf = e.key.rsplit(".", 1)[-1]
        if knode is not None:
            first, end = knode.start_mark.line, _end(vnode)
            if e.remove:
                for i in range(first, end.line + 1):
                    line = replaced.get(i, lines[i])
                    replaced[i] = _comment_out(line, note if i == first else "\n")
                continue
            if not (isinstance(vnode, yaml.ScalarNode) or vnode.flow_style or vnode.start_mark.line == end.line):
                start_line = knode.end_mark.line
                head = lines[start_line][:knode.end_mark.column]
                old = "".join(lines[start_line:end.line + 1])[len(head):].strip()
                replaced[start_line] = f"{head}: {_flow(e.value)}  # vramplan: was {_oneline(old)}; " \
                                       f"{one_line(e.why)}\n"
                for i in range(start_line + 1, end.line + 1):
                    replaced[i] = ""
                continue
            line_no = vnode.start_mark.line
            line = replaced.get(line_no, lines[line_no])
            old = line[vnode.start_mark.column:end.column] if end.line == line_no else line[vnode.start_mark.column:]
            new = line[:vnode.start_mark.column] + _flow(e.value) + line[end.column:] if end.line == line_no else None
            if new is None:
                raise SpecError(f"{where}: {e.key} spans several lines; vramplan cannot rewrite it in place")
            replaced[line_no] = new.rstrip("\n") + f"  # vramplan: was {_oneline(old.strip())}; {one_line(e.why)}\n"
            continue
        if e.remove:
            continue  # nothing to remove
        note = f"  # vramplan: added; {one_line(e.why)}\n"
        if parent is not None and parent is not root and not parent.flow_style and parent.value:
            col = parent.value[0][0].start_mark.column
            after = _end(parent).line + 1
            inserts.setdefault(after, []).append(" " * col + f"{leaf}: {_flow(e.value)}" + note)
        elif parent is root:
            appended.append(f"{leaf}: {_flow(e.value)}" + note)
        elif parent is not None:
            raise SpecError(f"{where}: {e.key.rsplit('.', 1)[0]} is a flow mapping ({{...}}); vramplan adds keys "
                            "only to block mappings")
        else:  # a parent block the file lacks: the key path at the end
            parts = e.key.split(".")
            value = e.value
            for part in reversed(parts[1:]):
                value = {part: value}
            appended.append(f"{parts[0]}: {_flow(value)}" + note)
    out = []
    for i, line in enumerate(lines):
        out.extend(inserts.get(i, []))
        out.append(replaced.get(i, line))
    out.extend(inserts.get(len(lines), []))
    written = "".join(out) + "".join(appended)
    _check(written, edits, where)
    return written


def _check(text: str, edits: list[Edit], where: str) -> None:
    """The edited text parses and has every edit's value (a line edit that went wrong is an error,
    never a file written)."""
    from ..setup.inputs import loads_yaml

    data = loads_yaml(text, where)
    for e in edits:
        got = _get(data, e.key)
        if got is not (_ABSENT if e.remove else e.value) and got != (_ABSENT if e.remove else e.value):
            raise SpecError(f"{where}: writing {e.key} back did not give {e.value!r} (got {got!r}); "
                            "write the config with vramplan emit instead")


def _oneline(text: str) -> str:
    return one_line(" ".join(text.split()))


def _comment_out(line: str, note: str) -> str:
    body = line.rstrip("\n")
    indent = len(body) - len(body.lstrip())
    return body[:indent] + "# " + body[indent:] + (note.rstrip("\n").replace("  # vramplan:", "  # vramplan: removed;")
                                                    if note.strip() else "") + "\n"


def _edit_json(text: str, edits: list[Edit], where: str) -> str:
    from ..setup.inputs import loads_json

    data = loads_json(text, where)
    for e in edits:
        if "." in e.key:
            raise SpecError(f"{where}: {e.key}: nested JSON keys are not written back")
        if e.remove:
            data.pop(e.key, None)
        else:
            data[e.key] = e.value
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _target(fmt: str, plan: Plan, model: ModelSpec, model_id: str) -> dict:
    from .frameworks import writer_for

    return writer_for("trl" if fmt == "hf" else fmt)(plan.setup, model, model_id=model_id, nodes=plan.nodes)


def write_back(read, source_setup: Setup, plan: Plan, model: ModelSpec, as_written: Breakdown) -> dict[str, str]:
    """File name -> text for ``plan --from FILE --emit DIR``: the user's file (its own name) with
    the plan's changes, the DeepSpeed JSON / accelerate YAML those changes need, the plan file and
    :data:`CHANGES_FILE`. A change the format cannot carry is a SpecError (nothing is written)."""
    from ..plans.planfile import dumps_plan
    from ..readers import setup_changes
    from ..readers.trl_args import COMMAND_SUFFIXES
    from ..setup.inputs import read_text
    from .accelerate import accelerate_config
    from .frameworks import companion_files, refusal

    fmt = read.format
    if fmt not in ("axolotl", "llamafactory", "trl", "torchtune", "hf"):
        raise SpecError(f"cannot write the plan back into a {fmt} file alone; use vramplan emit PLAN --format ...")
    if Path(read.path).suffix.lower() in COMMAND_SUFFIXES:
        raise SpecError(f"cannot write the plan back into {read.path}: it is a command line, not a config file; "
                        f"write the plan as a config with --out PLAN, then vramplan emit PLAN --format {fmt}")
    changes = setup_changes(source_setup, plan.setup)
    check = "trl" if fmt == "hf" else fmt
    why = refusal(fmt, plan.setup, model)  # hf: as trl's fields, with the HF Trainer's loss (hf_configs.refusal)
    if why and why != refusal(fmt, source_setup, model):
        raise SpecError(f"cannot write the plan back into {read.path}: {check} cannot express {why}")
    if fmt == "hf" and {c.field for c in changes} & {"method", "quant", "precision", "seq"}:
        raise SpecError(f"cannot write the plan back into {read.path}: TrainingArguments do not carry the model's "
                        "method, quantization, dtype or sequence length (the training script does)")
    edits = _edits(fmt, changes, plan, as_written, _target(fmt, plan, model, read.model or plan.model))
    path = Path(read.path)
    text = read_text(path, "training config")
    written = _edit_json(text, edits, str(path)) if path.suffix.lower() == ".json" else edit_yaml(text, edits,
                                                                                                  str(path))
    files = {path.name: written}
    companions = companion_files(plan, check, model)
    if any(e.key == "deepspeed" and not e.remove for e in edits):
        files[DS_CONFIG] = companions[DS_CONFIG]
    if {c.field for c in changes} & _ACCELERATE_FIELDS.get(fmt, set()) and plan.setup.gpus > 1:
        files[ACCELERATE_CONFIG] = companions.get(ACCELERATE_CONFIG) or yaml.safe_dump(accelerate_config(plan))
    files["vramplan.json"] = dumps_plan(plan)
    files[CHANGES_FILE] = changes_md(read.path, path.name, changes, edits, plan, as_written, files)
    return files


def changes_md(source: str, name: str, changes, edits: list[Edit], plan: Plan, as_written: Breakdown,
               files: dict) -> str:
    """The note that goes with the written file: what changed, in which keys, and why."""
    from .. import __version__

    out = [f"# vramplan {__version__}: {name}, planned from {one_line(source)}", ""]
    if not changes:
        out.append("The plan keeps the file's setup: nothing changed.")
    for c in changes:
        keys = [e.key + (" (removed)" if e.remove else f" = {_flow(e.value)}") for e in edits if e.why ==
                reason(c, plan, as_written)]
        out.append(f"- {one_line(reason(c, plan, as_written))}" + (f": {', '.join(keys)}" if keys else ""))
    extra = [n for n in files if n not in (name, CHANGES_FILE)]
    if extra:
        out += ["", "Also written: " + ", ".join(extra) + "."]
    return "\n".join(out) + "\n"
