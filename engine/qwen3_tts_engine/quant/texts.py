"""The texts quality is measured on (no mlx here: the command line checks its arguments
against them before it imports the toolkit)."""

# Short, varied English sentences; calibration texts are disjoint from evaluation texts.
EVAL_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things from the store.",
    "Your flight to Boston leaves at seven forty tomorrow morning.",
    "I'm sorry, could you say that again a little more slowly?",
    "Thirty-six apples cost four dollars and twenty cents.",
    "Turn left at the second light, then keep going until you see the bridge.",
)
CALIBRATION_TEXTS = (
    "Good morning, how can I help you today?",
    "The meeting has been moved to Thursday afternoon at three.",
    "She sells sea shells by the sea shore.",
    "Your package was delivered to the front desk an hour ago.",
    "Let me check that for you, it will only take a moment.",
    "We can offer you a table for two at eight o'clock tonight.",
    "Could you please repeat the last part of the address?",
    "The train to Paris is delayed by twenty minutes.",
    "Remember to water the plants on Sunday.",
    "Our office opens at nine and closes at five.",
    "How many tickets would you like to buy?",
    "This call may be recorded for training purposes.",
)
