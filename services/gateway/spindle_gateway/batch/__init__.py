"""The OpenAI Batch API on the gateway: uploaded files, batches of requests run as throughput-class work, results
in output and error files; all of it in one SQLite file that outlives the gateway."""
