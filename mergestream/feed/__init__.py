"""The signed update feed an edge fleet polls (issue 16), built with The Update Framework.

A feed is a static folder any HTTP server, CDN or bucket can serve::

    metadata/   TUF metadata (python-tuf's Metadata API): N.root.json, N.targets.json,
                N.snapshot.json (consistent snapshots) and timestamp.json
    targets/    the target files, named ``<sha256>.<name>`` (consistent snapshots):
                patches/<from>-<to>.safetensors   version patches (:mod:`mergestream.patches`)
                models/<version>/<file>           every file of a full model folder
                latest.json                       what devices should run now

Each target carries ``custom.mergestream`` (see :mod:`mergestream.feed.layout`): a patch names its
from/to versions and weights hashes, a model file its version and weights hash, ``latest.json``
the version and weights hash every device should converge to.

The fleet contract (standard library only; the device agent imports it): :mod:`.layout` (target
names, custom fields, durations) and :mod:`.plan` (the shortest verified path to ``latest``). The
publisher side: :mod:`.keys`, :mod:`.build` (reads the daemon's versions through
:mod:`mergestream.io.versions`, never the daemon), the command group :mod:`.cli`. The device side
is :mod:`mergestream.agent`, which imports this package and never the reverse.
"""
