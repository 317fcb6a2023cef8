"""The soak (issue 42 item 7): mixed traffic for a long while through a live stack, sampled once a minute, judged
for growth after warm-up and for anything held at the end. `python -m loadtest.faults.soak` (`make soak`)."""
