"""Regenerate torchtune_0.6.1.json: the public names of every torchtune 0.6.1 module and the
``cfg.KEY``s each recipe reads, read from the PyPI wheel's source with ast (no import: torchtune
0.6.1 needs torchao < 0.14, which peft 0.21 refuses, so it is not installed with the test extra).

    pip download torchtune==0.6.1 --no-deps -d /tmp/tt && cd /tmp/tt && unzip -q torchtune-0.6.1-*.whl -d src
    python tests/data/make_torchtune_index.py /tmp/tt
"""

import ast
import hashlib
import json
import pathlib
import re
import sys


def main(where: str) -> None:
    base = pathlib.Path(where)
    root = base / "src"
    names = {}
    for f in sorted(root.glob("torchtune/**/*.py")):
        mod = ".".join(f.relative_to(root).with_suffix("").parts)
        mod = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod
        defined = set()
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.ImportFrom):
                defined.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        names[mod] = sorted(n for n in defined if not n.startswith("_"))
    recipes = {f.stem: sorted(set(re.findall(r"\bcfg\.([a-z_]+)\b(?!\()", f.read_text())) - {"get"})
               for f in sorted(root.glob("recipes/*.py"))}
    wheel = next(base.glob("torchtune-*.whl"))
    out = {"source": "torchtune 0.6.1 wheel from PyPI (torchtune-0.6.1-py3-none-any.whl), read with ast: no import",
           "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
           "generated_by": "tests/data/make_torchtune_index.py", "modules": names, "recipe_cfg_keys": recipes}
    path = pathlib.Path(__file__).with_name("torchtune_0.6.1.json")
    path.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
