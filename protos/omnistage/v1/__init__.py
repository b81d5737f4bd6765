"""Generated gRPC/protobuf code of the omnistage.v1 API (from protos/, never edited by hand)."""
