import tempfile
import unittest
from pathlib import Path

from svcconf import ConfigError, load


class HiddenPrecedenceTest(unittest.TestCase):
    def setUp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        self.path = Path(d.name) / "svc.ini"
        self.path.write_text(
            "[service]\nport = 81\nworkers = 2\ndebug = off\nlog_level = error\n"
            "db_url = sqlite:///file.db\nrequest_timeout = 5\n"
        )

    def test_every_setting_from_the_environment_wins(self):
        env = {
            "SVC_PORT": "82", "SVC_WORKERS": "3", "SVC_DEBUG": "on", "SVC_LOG_LEVEL": "debug",
            "SVC_DB_URL": "sqlite:///env.db", "SVC_REQUEST_TIMEOUT": "6",
        }
        s = load(self.path, environ=env)
        self.assertEqual(
            dict(s.values),
            {"port": 82, "workers": 3, "debug": True, "log_level": "debug",
             "db_url": "sqlite:///env.db", "request_timeout": 6},
        )

    def test_the_file_still_beats_the_defaults(self):
        s = load(self.path, environ={"SVC_WORKERS": "12", "OTHER": "x", "SVC_COLOUR": "red"})
        self.assertEqual((s.port, s.workers, s.debug, s.request_timeout), (81, 12, False, 5))

    def test_environment_without_a_file(self):
        self.assertEqual(load(environ={"SVC_DEBUG": "1"}).debug, True)

    def test_a_bad_environment_value_is_an_error(self):
        with self.assertRaisesRegex(ConfigError, "port"):
            load(self.path, environ={"SVC_PORT": "http"})


if __name__ == "__main__":
    unittest.main()
