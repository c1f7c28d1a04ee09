"""`thorgen cluster`: engine replicas on Ray Serve behind one OpenAI endpoint, with prefix-affinity routing."""
