"""The plugin API, what the upstream patch (patches/) carries into the host: hook specs, the plugin manager, plugin
names, the exceptions a plugin raises, the engine decorator. Imports nothing: the bridge reads plugin names on every
``vllm-mlx`` start, before anything heavy (pluggy) may load."""
