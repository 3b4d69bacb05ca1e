"""Print the first ```bash block under the README section whose heading starts with a word."""

import re
import sys


def first_bash_block(text: str, section: str) -> str:
    heading = re.compile(rf"^##\s*{re.escape(section)}", re.IGNORECASE | re.MULTILINE)
    match = heading.search(text)
    if match is None:
        raise SystemExit(f"README has no '## {section}' section")
    rest = text[match.end():]
    next_heading = re.search(r"^##\s", rest, re.MULTILINE)
    body = rest[: next_heading.start()] if next_heading else rest
    block = re.search(r"^```bash\n(.*?)^```", body, re.MULTILINE | re.DOTALL)
    if block is None:
        raise SystemExit(f"README section '## {section}' has no ```bash block")
    return block.group(1)


if __name__ == "__main__":
    path, section = sys.argv[1], sys.argv[2]
    with open(path, encoding="utf-8") as fh:
        sys.stdout.write(first_bash_block(fh.read(), section))
