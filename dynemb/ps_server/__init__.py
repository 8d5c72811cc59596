"""The dynemb parameter server: a gRPC service over Redis or an embedded store, and its client."""
