"""The offline harness: spoken turns through the pipeline without a room (`demo`, `conversation`,
`audio_io`), real speech with known words (`speech_assets`, `phone_line`), and the stand-ins a
call needs on loopback, which the lab and the tests share: a livekit-server (`livekit_server`),
an OpenAI-compatible chat server (`openai_stand_in`) and a caller in a room (`caller`).

Nothing here is imported at package import: each module is imported where it is used.
"""
