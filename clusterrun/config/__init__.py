"""The hosts file: parsed and validated once into a frozen ``ClusterSpec``, with its node sets and settings."""
