//! Reading the usage of a compressed answer: the scanner is fed a decoded copy of the bytes,
//! decoded as they arrive, while the client gets the upstream's bytes unchanged.
//!
//! `Content-Encoding` names the coding: `gzip` (and `x-gzip`), `deflate` (zlib, or raw
//! deflate as some servers send it), `br`, `zstd`, or `identity`. Anything else, or more
//! than one coding stacked, is not decoded: no figure, so the whole reservation is kept
//! (safe: the limit under-admits). A decoder that fails (corrupt data, a zstd window above
//! `ZSTD_WINDOW_MAX`) stops for good, with the same result.
//!
//! Bounded, per answer: memory is the decoder's window (32 KiB for gzip and deflate; the
//! stream's own for br, at most 16 MiB by the format; at most `ZSTD_WINDOW_MAX` for zstd,
//! the bound RFC 8878 sets for HTTP) plus fixed buffers; the scanner holds what
//! `usage` says. Decoding work is bounded by the decoded bytes: at most `DECODED_MAX` in
//! all, and at most `RATIO_MAX` times the compressed bytes so far plus `RATIO_SLACK`. A
//! decompression bomb (a few KiB that decode to gigabytes) passes one of these within a
//! frame or two and stops decoding: the reservation is kept, which is what an answer
//! without a figure gets.

use std::io::{self, Write};

use brotli_decompressor::DecompressorWriter;
use flate2::write::{DeflateDecoder, MultiGzDecoder, ZlibDecoder};
use ruzstd::decoding::FrameDecoder;

use super::{Usage, UsageScanner};

/// Most decoded bytes scanned for one answer.
pub const DECODED_MAX: u64 = 64 << 20;
/// Most decoded bytes per compressed byte read so far (text and JSON rarely pass 20:1; a
/// bomb's ratio is about 1,000:1 for deflate and far more for br and zstd) ...
pub const RATIO_MAX: u64 = 256;
/// ... beyond this many, so that a small answer is never held to the ratio.
pub const RATIO_SLACK: u64 = 1 << 20;
/// Largest zstd window decoded (RFC 8878 §3.1.1.1.2 bounds HTTP's at 8 MiB).
pub const ZSTD_WINDOW_MAX: u64 = 8 << 20;

/// The bytes of one decoded output buffer.
const CHUNK: usize = 8 * 1024;

/// Where decoded bytes go: the scanner, within the bounds.
struct Sink {
    scanner: UsageScanner,
    decoded: u64,
    /// Decoded bytes allowed so far (raised as compressed bytes arrive).
    allowed: u64,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.decoded += buf.len() as u64;
        if self.decoded > self.allowed {
            return Err(io::Error::other("decoded past the bound"));
        }
        self.scanner.feed(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

enum Decoder {
    Gzip(MultiGzDecoder<Sink>),
    /// `deflate` before its first two bytes tell zlib from raw deflate.
    Deflate {
        sink: Sink,
        head: Vec<u8>,
    },
    Zlib(ZlibDecoder<Sink>),
    RawDeflate(DeflateDecoder<Sink>),
    Brotli(Box<DecompressorWriter<Sink>>),
    Zstd(Box<Zstd>),
}

/// A usage scanner behind the decoder `Content-Encoding` names, if any.
pub struct DecodingScanner {
    state: State,
    compressed: u64,
}

// The plain scanner is the common case and stays inline (no allocation per answer); the
// whole state lives in the answer's boxed body anyway.
#[allow(clippy::large_enum_variant)]
enum State {
    Plain(UsageScanner),
    /// Boxed: only a compressed answer pays for a decoder's size.
    Decoding(Box<Decoder>),
    /// Not decodable, or the decoder stopped: no figure.
    Stopped,
}

impl DecodingScanner {
    /// A scanner for an answer of `content_type` coded as `content_encoding` says.
    pub fn new(content_type: Option<&[u8]>, content_encoding: Option<&[u8]>) -> DecodingScanner {
        let scanner = UsageScanner::for_content_type(content_type);
        let sink = Sink {
            scanner,
            decoded: 0,
            allowed: RATIO_SLACK,
        };
        let codings: Vec<&[u8]> = content_encoding
            .unwrap_or_default()
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"))
            .collect();
        let state = match codings[..] {
            [] => State::Plain(sink.scanner),
            [coding] => match coding.to_ascii_lowercase().as_slice() {
                b"gzip" | b"x-gzip" => {
                    State::Decoding(Box::new(Decoder::Gzip(MultiGzDecoder::new(sink))))
                }
                b"deflate" => State::Decoding(Box::new(Decoder::Deflate {
                    sink,
                    head: Vec::with_capacity(2),
                })),
                b"br" => State::Decoding(Box::new(Decoder::Brotli(Box::new(
                    DecompressorWriter::new(sink, CHUNK),
                )))),
                b"zstd" => State::Decoding(Box::new(Decoder::Zstd(Box::new(Zstd::new(sink))))),
                _ => State::Stopped,
            },
            // Stacked codings: not decoded.
            _ => State::Stopped,
        };
        DecodingScanner {
            state,
            compressed: 0,
        }
    }

    /// Feeds the answer's next bytes, as the upstream sent them.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.compressed += bytes.len() as u64;
        let allowed =
            DECODED_MAX.min(RATIO_SLACK.saturating_add(self.compressed.saturating_mul(RATIO_MAX)));
        let decoder = match &mut self.state {
            State::Plain(scanner) => return scanner.feed(bytes),
            State::Stopped => return,
            State::Decoding(decoder) => decoder,
        };
        if decoder.feed(bytes, allowed).is_err() {
            self.state = State::Stopped;
        }
    }

    /// The usage of a stream whose last event has passed (`UsageScanner::ended`), before its
    /// body has ended: a client may close as soon as it has that event, and the figure is
    /// whole by then. `None` before it, or when the bytes could not be decoded.
    pub fn usage_at_last_event(&mut self) -> Option<Usage> {
        let scanner = match &mut self.state {
            State::Plain(scanner) => &*scanner,
            State::Decoding(decoder) => &decoder.sink().scanner,
            State::Stopped => return None,
        };
        scanner.ended().then(|| scanner.usage())
    }

    /// What the answer reported, once its body has ended: `None` when its bytes could not
    /// all be decoded (a `Usage` without a whole figure when it gave none).
    pub fn usage(&mut self) -> Option<Usage> {
        let state = std::mem::replace(&mut self.state, State::Stopped);
        match state {
            State::Plain(scanner) => Some(scanner.usage()),
            State::Stopped => None,
            State::Decoding(decoder) => Some((*decoder).finish().ok()?.usage()),
        }
    }
}

impl Decoder {
    fn sink(&mut self) -> &mut Sink {
        match self {
            Decoder::Gzip(d) => d.get_mut(),
            Decoder::Deflate { sink, .. } => sink,
            Decoder::Zlib(d) => d.get_mut(),
            Decoder::RawDeflate(d) => d.get_mut(),
            Decoder::Brotli(d) => d.get_mut(),
            Decoder::Zstd(d) => &mut d.sink,
        }
    }

    fn feed(&mut self, bytes: &[u8], allowed: u64) -> io::Result<()> {
        self.sink().allowed = allowed;
        match self {
            Decoder::Gzip(d) => write_all(d, bytes),
            Decoder::Zlib(d) => write_all(d, bytes),
            Decoder::RawDeflate(d) => write_all(d, bytes),
            Decoder::Brotli(d) => write_all(d.as_mut(), bytes),
            Decoder::Zstd(d) => d.feed(bytes),
            Decoder::Deflate { head, .. } => {
                let take = bytes.len().min(2 - head.len());
                head.extend_from_slice(&bytes[..take]);
                if head.len() < 2 {
                    return Ok(());
                }
                let head = std::mem::take(head);
                self.choose_deflate(&head)?;
                self.feed(&bytes[take..], allowed)
            }
        }
    }

    /// `deflate` is zlib-wrapped by the standard (RFC 9110 §8.4.1.2), raw in some servers:
    /// a zlib header is a deflate method byte whose pair with the next is a multiple of 31.
    fn choose_deflate(&mut self, head: &[u8]) -> io::Result<()> {
        let Decoder::Deflate { sink, .. } = self else {
            return Ok(());
        };
        let sink = std::mem::replace(
            sink,
            Sink {
                scanner: UsageScanner::for_content_type(None),
                decoded: 0,
                allowed: 0,
            },
        );
        let zlib = head[0] & 0x0f == 8 && (u16::from(head[0]) << 8 | u16::from(head[1])) % 31 == 0;
        *self = if zlib {
            Decoder::Zlib(ZlibDecoder::new(sink))
        } else {
            Decoder::RawDeflate(DeflateDecoder::new(sink))
        };
        match self {
            Decoder::Zlib(d) => write_all(d, head),
            Decoder::RawDeflate(d) => write_all(d, head),
            _ => Ok(()),
        }
    }

    /// Ends the stream: the scanner, once every byte is decoded and the coding's end checked.
    fn finish(self) -> io::Result<UsageScanner> {
        let sink = match self {
            Decoder::Gzip(d) => d.finish()?,
            Decoder::Zlib(d) => d.finish()?,
            Decoder::RawDeflate(d) => d.finish()?,
            Decoder::Brotli(mut d) => {
                d.close()?;
                d.into_inner()
                    .map_err(|_| io::Error::other("brotli stream unfinished"))?
            }
            Decoder::Zstd(d) => d.finish()?,
            // Fewer than two bytes: not a deflate stream.
            Decoder::Deflate { .. } => return Err(io::Error::other("deflate stream too short")),
        };
        Ok(sink.scanner)
    }
}

fn write_all(writer: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    writer.write_all(bytes)?;
    writer.flush()
}

/// zstd, decoded a block at a time: `ruzstd`'s decoder takes whole blocks, so the
/// compressed bytes of an unfinished block (at most 128 KiB and a header) wait in `pending`.
struct Zstd {
    decoder: FrameDecoder,
    /// Whether `decoder` holds a frame begun and not yet finished.
    in_frame: bool,
    pending: Vec<u8>,
    out: Box<[u8; CHUNK]>,
    sink: Sink,
}

/// A zstd frame's magic number, little-endian.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// Longest zstd frame header: magic, descriptor, window, dictionary id, content size.
const ZSTD_HEADER_MAX: usize = 4 + 1 + 1 + 4 + 8;
/// A block's most compressed bytes and its header, past which `pending` cannot grow.
const ZSTD_PENDING_MAX: usize = (128 << 10) + 3 + ZSTD_HEADER_MAX;

impl Zstd {
    fn new(sink: Sink) -> Zstd {
        Zstd {
            decoder: FrameDecoder::new(),
            in_frame: false,
            pending: Vec::new(),
            out: Box::new([0; CHUNK]),
            sink,
        }
    }

    fn feed(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.pending.extend_from_slice(bytes);
        self.decode(false)?;
        if self.pending.len() > ZSTD_PENDING_MAX {
            return Err(io::Error::other("zstd block larger than the format allows"));
        }
        Ok(())
    }

    /// Decodes what `pending` holds; at the end of the body, what remains must be nothing.
    fn decode(&mut self, end: bool) -> io::Result<()> {
        loop {
            if !self.in_frame {
                if self.pending.is_empty() {
                    return Ok(());
                }
                let Some(window) = zstd_window(&self.pending) else {
                    if end || self.pending.len() >= ZSTD_HEADER_MAX {
                        return Err(io::Error::other("not a zstd frame header"));
                    }
                    return Ok(());
                };
                if window > ZSTD_WINDOW_MAX {
                    return Err(io::Error::other("zstd window above the bound"));
                }
                self.decoder
                    .reset(&mut self.pending.as_slice())
                    .map_err(io::Error::other)?;
                // `reset` read the header from a copy of the slice: drop it from `pending`.
                let header = usize::try_from(self.decoder.bytes_read_from_source())
                    .unwrap_or(usize::MAX)
                    .min(self.pending.len());
                self.pending.drain(..header);
                self.in_frame = true;
            }
            let (read, written) = self
                .decoder
                .decode_from_to(&self.pending, &mut self.out[..])
                .map_err(io::Error::other)?;
            self.pending.drain(..read.min(self.pending.len()));
            self.sink.write_all(&self.out[..written])?;
            // Finished: its last block decoded, its checksum (if any) read, its bytes drained.
            if self.decoder.is_finished() && self.decoder.can_collect() == 0 {
                self.in_frame = false;
                continue;
            }
            if read == 0 && written == 0 {
                if end {
                    return Err(io::Error::other("zstd stream cut short"));
                }
                return Ok(());
            }
        }
    }

    fn finish(mut self) -> io::Result<Sink> {
        self.decode(true)?;
        if self.in_frame {
            return Err(io::Error::other("zstd stream cut short"));
        }
        Ok(self.sink)
    }
}

/// The window a zstd frame header declares, when `bytes` begin with a whole one.
fn zstd_window(bytes: &[u8]) -> Option<u64> {
    if bytes.get(..4)? != ZSTD_MAGIC {
        return None;
    }
    let descriptor = *bytes.get(4)?;
    let single_segment = descriptor & 0x20 != 0;
    if !single_segment {
        let window = *bytes.get(5)?;
        let base = 1u64 << (10 + (window >> 3));
        return Some(base + (base / 8) * u64::from(window & 7));
    }
    // A single segment's window is its content size, after the dictionary id.
    let dictionary = [0, 1, 2, 4][usize::from(descriptor & 3)];
    let size_bytes = [1, 2, 4, 8][usize::from(descriptor >> 6)];
    let start = 5 + dictionary;
    let field = bytes.get(start..start + size_bytes)?;
    let mut size = [0u8; 8];
    size[..size_bytes].copy_from_slice(field);
    let size = u64::from_le_bytes(size);
    Some(if size_bytes == 2 { size + 256 } else { size })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER: &[u8] = br#"{"id":"c","usage":{"prompt_tokens":30,"completion_tokens":70}}"#;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn scan(encoding: Option<&[u8]>, body: &[u8], frame: usize) -> Option<u64> {
        let mut scanner = DecodingScanner::new(Some(b"application/json"), encoding);
        for piece in body.chunks(frame) {
            scanner.feed(piece);
        }
        scanner.usage().and_then(|usage| usage.used())
    }

    #[test]
    fn gzip_is_decoded_byte_by_byte_and_whole() {
        let body = gzip(ANSWER);
        assert_eq!(scan(Some(b"gzip"), &body, 1), Some(100));
        assert_eq!(scan(Some(b" GZIP "), &body, body.len()), Some(100));
        assert_eq!(scan(Some(b"identity"), ANSWER, 7), Some(100));
        assert_eq!(scan(None, ANSWER, 7), Some(100));
    }

    #[test]
    fn stacked_unknown_cut_or_corrupt_codings_give_no_figure() {
        let body = gzip(ANSWER);
        assert_eq!(scan(Some(b"gzip, br"), &body, 16), None);
        assert_eq!(scan(Some(b"compress"), &body, 16), None);
        assert_eq!(scan(Some(b"gzip"), &body[..body.len() - 4], 16), None);
        assert_eq!(scan(Some(b"gzip"), ANSWER, 16), None);
        assert_eq!(scan(Some(b"br"), ANSWER, 16), None);
        assert_eq!(scan(Some(b"zstd"), ANSWER, 16), None);
        assert_eq!(scan(Some(b"deflate"), b"x", 16), None);
    }

    #[test]
    fn a_zstd_window_above_the_bound_is_not_decoded() {
        // Window descriptor: exponent 14 → 2^24 (16 MiB), no mantissa.
        let mut header = ZSTD_MAGIC.to_vec();
        header.extend_from_slice(&[0x00, 14 << 3]);
        assert_eq!(zstd_window(&header), Some(16 << 20));
        assert_eq!(scan(Some(b"zstd"), &header, 64), None);
        // A single segment of 300 bytes (2-byte field, +256).
        let mut single = ZSTD_MAGIC.to_vec();
        single.extend_from_slice(&[0x60, 44, 0]);
        assert_eq!(zstd_window(&single), Some(300));
    }

    #[test]
    fn decoding_stops_past_the_ratio() {
        // 16 MiB of one byte (about 1,000:1): far past 256 times its compressed size plus
        // the slack, though its usage comes first.
        let mut body = gzip(br#"{"usage":{"total_tokens":5},"x":""#);
        body.extend(gzip(&vec![b'x'; 16 << 20]));
        body.extend(gzip(br#""}"#));
        assert!(body.len() < 64 << 10, "{}", body.len());
        assert_eq!(scan(Some(b"gzip"), &body, 1024), None);
    }

    /// `body` coded as `coding` names, by the same encoders a real server's libraries use.
    fn encode(coding: &str, body: &[u8]) -> Vec<u8> {
        match coding {
            "gzip" => gzip(body),
            "deflate" => {
                let mut e =
                    flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(body).unwrap();
                e.finish().unwrap()
            }
            // `deflate` as some servers send it: raw, without the zlib wrapper.
            "raw-deflate" => {
                let mut e =
                    flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(body).unwrap();
                e.finish().unwrap()
            }
            "br" => {
                let mut out = Vec::new();
                let mut e = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                e.write_all(body).unwrap();
                drop(e);
                out
            }
            "zstd" => {
                ruzstd::encoding::compress_to_vec(body, ruzstd::encoding::CompressionLevel::Fastest)
            }
            _ => unreachable!("{coding}"),
        }
    }

    proptest::proptest! {
        /// Whatever the coding and however the bytes are cut into frames, the decoded
        /// answer gives the figure the plain answer gives.
        #[test]
        fn every_coding_and_framing_gives_the_plain_figure(
            prompt in 0u32..1_000_000,
            completion in 0u32..1_000_000,
            padding in 0usize..20_000,
            frame in 1usize..4096,
            coding in proptest::sample::select(vec!["gzip", "deflate", "raw-deflate", "br", "zstd"]),
        ) {
            let plain = format!(
                r#"{{"id":"c","text":"{}","usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion}}}}}"#,
                "abc ".repeat(padding / 4)
            );
            let want = scan(None, plain.as_bytes(), frame);
            proptest::prop_assert_eq!(want, Some(u64::from(prompt) + u64::from(completion)));
            let name = if coding == "raw-deflate" { "deflate" } else { coding };
            let coded = encode(coding, plain.as_bytes());
            proptest::prop_assert_eq!(scan(Some(name.as_bytes()), &coded, frame), want);
        }

        /// Bytes that are not what the coding says never panic and never give a figure
        /// the plain scanner would not: at most no figure at all.
        #[test]
        fn garbage_never_panics_nor_invents_a_figure(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
            frame in 1usize..512,
            coding in proptest::sample::select(vec!["gzip", "deflate", "br", "zstd"]),
        ) {
            let got = scan(Some(coding.as_bytes()), &bytes, frame);
            proptest::prop_assert!(got.is_none() || got == Some(0), "{got:?}");
        }
    }
}
