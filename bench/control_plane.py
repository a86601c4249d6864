"""placeholder"""

from bench.harness import Section


def run(sec: Section, quick: bool) -> None:
    raise NotImplementedError("not yet")
