"""The shared entry codec: msgpack bodies and content-addressed token blocks."""
