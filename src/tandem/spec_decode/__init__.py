"""Speculative decoding: proposers guess a request's next tokens, the target model scores them
all in one step (worker/rejection_sampler.py keeps what it would have produced), and the
scheduler decides per request and per step how many guesses are worth their cost."""
