"""Copy the native libraries a wheel carries (and each one's build info) into a source tree:
python .ci/unpack_native.py WHEEL SRC."""

import sys
import zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
    libraries = [name for name in names if name.startswith("fullgraph/") and name.endswith(".so")]
    if not libraries:
        sys.exit(f"{wheel}: no native library in it (built without FULLGRAPH_BUILD_EXT=1?)")
    for library in libraries:
        for name in (library, library.removesuffix(".so") + ".json"):
            if name not in names:
                sys.exit(f"{wheel}: {name} is missing")
            (src / name).write_bytes(archive.read(name))
            print(f"unpacked {name}")
