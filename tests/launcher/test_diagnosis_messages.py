"""The launcher's one-line report of a failed rank quotes the meaningful part of its message:
gloo's build-machine source path and its boilerplate advice are dropped (the expected lines are
written out by hand from messages gloo 2.x and c10d print)."""
from mpu_lab.launcher import diagnosis

GLOO_READ_ERROR = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
    "error [127.0.0.1]:41175: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application. Check the logs of the remote worker before "
    "reporting an error. GLHF! \N{UMBRELLA ON GROUND}\N{VARIATION SELECTOR-16}")
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                "unbound_buffer.cc:129] Timed out waiting 8000ms for send operation to complete")


def test_a_gloo_read_error_is_quoted_without_its_source_path_and_advice():
    assert diagnosis.quote_message(GLOO_READ_ERROR) == (
        "RuntimeError: Read error [127.0.0.1]:41175: Connection reset by peer (in pair.cc:537)")


def test_a_gloo_timeout_keeps_its_whole_sentence_and_the_file_name():
    assert diagnosis.quote_message(GLOO_TIMEOUT) == (
        "RuntimeError: Timed out waiting 8000ms for send operation to complete "
        "(in unbound_buffer.cc:129)")


def test_a_message_of_the_rank_own_code_is_left_as_it_is():
    own = "RuntimeError: rank 1 raised at iteration 2 (fault injected by --inject-fault crash)"
    assert diagnosis.quote_message(own) == own
    assert diagnosis.quote_message("ValueError: shape [2] != [1]\nmore lines") == (
        "ValueError: shape [2] != [1]")
    assert diagnosis.quote_message("") == ""

