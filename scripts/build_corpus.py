"""Build the bundled corpus snapshot `data/corpus/` from Debian packages (see glm5/data/pipeline/corpus.py).

    apt-get install -y python3.11-doc debian-reference-en debian-reference-zh-cn manpages-zh fortunes fortunes-zh
    python scripts/build_corpus.py [--out data/corpus] [--validation-fraction 0.02]
"""

import argparse

from glm5.data.pipeline.corpus import build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--validation-fraction", type=float, default=0.02)
    args = ap.parse_args(argv)
    print(build(args.out, args.validation_fraction))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
