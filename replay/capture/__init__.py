"""From a live SGLang fleet to a trace (docs/capture.md).

* :mod:`.blockhash`  the router's and engine's block hash (CAPTURE.md s.3)
* :mod:`.wire`       LoadStat and KV-event frames: decode (both encodings)
* :mod:`.store`      the recorder's trace set: hive-partitioned Parquet parts written aside, then renamed
* :mod:`.recorder`   ``router-replay record``: subscribe, stamp, keep sequences, survive faults
* :mod:`.index`      the KV indexer's answer rebuilt from recorded events (and the placement model)
* :mod:`.importer`   ``router-replay import``: request sources + engine exports + events -> a trace dir
* :mod:`.from_sim`   a simulator run written in these capture formats (the round trip)
"""
