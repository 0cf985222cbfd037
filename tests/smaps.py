"""This process's memory mappings as the kernel counts them (/proc/self/smaps)."""

import re


def mappings() -> list[tuple[str | None, dict[str, list[str]]]]:
    """Each mapping: its path (None for anonymous memory) and its fields ("Rss:" -> ["12", "kB"],
    "VmFlags:" -> ["rd", "sh", ...])."""
    found: list[tuple[str | None, dict[str, list[str]]]] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):  # a header: range perms offset dev inode [path]
                found.append((fields[5] if len(fields) >= 6 else None, {}))
            elif found:
                found[-1][1][fields[0]] = fields[1:]
    return found
