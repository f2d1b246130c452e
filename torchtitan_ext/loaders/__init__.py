"""The torchtitan-facing layer: the only place (with config.py / train.py) that imports
torchtitan's trainer-side classes. Each module here is a thin ``BaseDataLoader`` subclass over a
framework-free dataset in ``text/``, ``vl/`` or ``device/``; ``integration`` holds what every
loader shares (staging wrapper, stats in the step log line). Loader modules are imported lazily
through the registry (``torchtitan_ext.registry``), not from here.
"""
