"""Regenerate the Python code for protos/kvstrata/v1/*.proto into protos/v1/.

    python -m kvstrata.protos.generate          # rewrite the generated files
    python -m kvstrata.protos.generate --check  # exit 1 if they are stale

The generated modules import each other as `kvstrata.protos.v1.*`; the descriptor keeps the proto's
own path (kvstrata/v1/generation.proto), which is what server reflection shows.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTOS = sorted((ROOT / "kvstrata" / "v1").glob("*.proto"))
OUT = ROOT / "v1"


def generated() -> dict[str, str]:
    """file name -> contents of the freshly generated modules."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *map(str, PROTOS)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(p.name for p in PROTOS)}")
        out = {}
        for path in sorted((Path(tmp) / "kvstrata" / "v1").iterdir()):
            text = path.read_text()
            # protoc writes imports relative to -I; the package lives at kvstrata.protos.v1
            text = text.replace("from kvstrata.v1 import", "from kvstrata.protos.v1 import")
            out[path.name] = text
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether the files are stale")
    args = parser.parse_args(argv)
    fresh = generated()
    stale = [name for name, text in fresh.items()
             if not (OUT / name).exists() or (OUT / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"stale: protos/v1/{name}; run python -m kvstrata.protos.generate", file=sys.stderr)
        return 1 if stale else 0
    OUT.mkdir(exist_ok=True)
    (OUT / "__init__.py").write_text('"""Generated from protos/kvstrata/v1 by kvstrata.protos.generate."""\n')
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(fresh)} files to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
