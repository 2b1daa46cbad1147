/* The native half of the pipeline: per-batch Example parse and crop-aware JPEG decode.
 *
 * A BatchDecoder holds a decode stage's fixed settings; each call takes a chunk of a batch's
 * records and, with the GIL released once for the whole chunk, for each record: finds the image
 * bytes and the label in the serialized tf.train.Example (no copy), reads the JPEG header, draws
 * the crop window and the flip from a counter-based hash of (seed, epoch, record index) (so a
 * record's augmentation does not depend on threads, workers or the resume point), and decodes
 * only that window (libjpeg-turbo's jpeg_crop_scanline and jpeg_skip_scanlines, DCT-scaled when
 * the window is >= 2x the target: tf.data's decode_and_crop_jpeg) into the caller's arena, then
 * resizes it into its batch slot, mirrored on the way, with OpenCV's bilinear pixels to the bit
 * (resize_linear); windows for another filter go back to the caller mirrored, for OpenCV to
 * resize (without a batch array: all of them, mirrored while decoded). Records it cannot
 * take (not a JPEG, CMYK, an unusual Example) are handed back for the Python path; broken ones
 * with the message the Python path would give.
 *
 * Warnings (corrupt data that libjpeg would paper over with grey, e.g. a truncated file) are
 * errors: a record is either decoded faithfully or reported. One is not: bytes between header
 * segments, which libjpeg skips (with a warning) before it reaches the image data, as the header
 * walk below does. A JPEG without its end-of-image marker is refused whatever the window.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

#define MSG 200
/* Decompression-bomb limit (Pillow's), exported as `_jpeg.MAX_PIXELS` for pipeline.image.decode. */
#define MAX_PIXELS 89478485ULL

/* ------------------------------------------------------------------ counter-based uniforms */

static uint64_t mix64(uint64_t z) { /* splitmix64's finalizer */
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

static uint64_t example_key(uint64_t seed, uint64_t epoch, uint64_t index) {
  return mix64(mix64(mix64(seed ^ 0x5DEECE66DULL) ^ epoch) ^ index);
}

/* Draw k of an example, uniform in [0, 1). */
static double uniform(uint64_t key, uint64_t k) {
  return (double)(mix64(key + (k + 1) * 0xD1B54A32D192ED03ULL) >> 11) * 0x1.0p-53;
}

/* ------------------------------------------------------------------ crop geometry */

typedef struct {
  int train, flip, dct_scaling, fast_dct, size, tf_crop, resize_first, flax_center;
  double area_lo, area_hi, ratio_lo, ratio_hi, log_ratio_lo, log_ratio_hi, crop_fraction;
  double min_covered; /* the "tf" crop's min_object_covered, the whole image its object */
} params_t;

#define ATTEMPTS 10 /* torchvision's RandomResizedCrop */
#define FLIP_DRAW (4 * ATTEMPTS)
#define TF_ATTEMPTS 100 /* sample_distorted_bounding_box's max_attempts default */
#define TF_DRAW 64      /* the "tf" crop's draws: TF_DRAW + 4 * attempt + (aspect, height, y, x) */

/* TF's sample_distorted_bounding_box (GenerateRandomCrop in
 * tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc, float32 as there): aspect
 * uniform, height uniform between the area bounds, offset in [0, h - ch); a crop covering less
 * than min_covered of the image (the whole image as the one box, as the Flax ImageNet example
 * passes it: SatisfiesOverlapConstraints) is another miss; after TF_ATTEMPTS misses, the whole
 * image. `augment.tf_inception_crop_box` is the same in Python. */
static void tf_crop_box(const params_t *p, long h, long w, uint64_t key, long box[4]) {
  const float lo = (float)p->ratio_lo, hi = (float)p->ratio_hi;
  const float min_area = (float)p->area_lo * (float)w * (float)h;
  const float max_area = (float)p->area_hi * (float)w * (float)h;
  for (int a = 0; a < TF_ATTEMPTS; a++) {
    uint64_t k = TF_DRAW + 4 * (uint64_t)a;
    float u = (float)(mix64(key + (k + 1) * 0xD1B54A32D192ED03ULL) >> 40) * 0x1.0p-24f;
    float aspect = u * (hi - lo) + lo;
    long ch = lrintf(sqrtf(min_area / aspect)), max_h = lrintf(sqrtf(max_area / aspect));
    if (lrintf((float)max_h * aspect) > w) {
      max_h = (long)((w + 0.5 - (double)0.0000001f) / (double)aspect);
      if (lrintf((float)max_h * aspect) > w) max_h -= 1;
    }
    if (max_h > h) max_h = h;
    if (ch >= max_h) ch = max_h;
    if (ch < max_h) ch += (long)(uniform(key, k + 1) * (double)(max_h - ch + 1));
    long cw = lrintf((float)ch * aspect);
    float area = (float)(cw * ch);
    if (area < min_area) {
      ch += 1;
      cw = lrintf((float)ch * aspect);
      area = (float)(cw * ch);
    }
    if (area > max_area) {
      ch -= 1;
      cw = lrintf((float)ch * aspect);
      area = (float)(cw * ch);
    }
    if (area >= min_area && area <= max_area && cw > 0 && cw <= w && ch > 0 && ch <= h &&
        (float)(cw * ch) / (float)(h * w) >= (float)p->min_covered) {
      box[0] = ch < h ? (long)(uniform(key, k + 2) * (double)(h - ch)) : 0;
      box[1] = cw < w ? (long)(uniform(key, k + 3) * (double)(w - cw)) : 0;
      box[2] = ch, box[3] = cw;
      return;
    }
  }
  box[0] = box[1] = 0, box[2] = h, box[3] = w;
}

/* The window to decode of an h x w image: box[] = y, x, ch, cw. Train: the "tf" crop, or
 * torchvision's RandomResizedCrop (after ATTEMPTS misses, the largest centred crop within the
 * aspect range). Eval: the centre crop, or the whole image (resize_then_crop). */
static void crop_box(const params_t *p, long h, long w, uint64_t key, long box[4]) {
  if (p->train && p->tf_crop) {
    tf_crop_box(p, h, w, key, box);
    return;
  }
  if (!p->train && p->resize_first) {
    box[0] = box[1] = 0, box[2] = h, box[3] = w;
    return;
  }
  if (!p->train && p->flax_center) { /* the Flax example's _decode_and_center_crop, float32 */
    long side = (long)((float)p->crop_fraction * (float)(h < w ? h : w));
    if (side < 1) side = 1;
    box[0] = (h - side + 1) / 2, box[1] = (w - side + 1) / 2, box[2] = side, box[3] = side;
    return;
  }
  if (!p->train) {
    long side = lround(fmin(h, w) * p->crop_fraction);
    if (side < 1) side = 1;
    box[0] = (h - side) / 2, box[1] = (w - side) / 2, box[2] = side, box[3] = side;
    return;
  }
  for (int a = 0; a < ATTEMPTS; a++) {
    double target = (double)h * w * (p->area_lo + uniform(key, 4 * a) * (p->area_hi - p->area_lo));
    double aspect = exp(p->log_ratio_lo + uniform(key, 4 * a + 1) * (p->log_ratio_hi - p->log_ratio_lo));
    long cw = lround(sqrt(target * aspect)), ch = lround(sqrt(target / aspect));
    if (cw > 0 && cw <= w && ch > 0 && ch <= h) {
      box[0] = (long)(uniform(key, 4 * a + 2) * (h - ch + 1));
      box[1] = (long)(uniform(key, 4 * a + 3) * (w - cw + 1));
      box[2] = ch, box[3] = cw;
      return;
    }
  }
  double in_ratio = (double)w / h, lo = exp(p->log_ratio_lo), hi = exp(p->log_ratio_hi);
  long ch = h, cw = w;
  if (in_ratio < lo) ch = lround(w / lo);
  else if (in_ratio > hi) cw = lround(h * hi);
  if (ch < 1) ch = 1;
  if (cw < 1) cw = 1;
  box[0] = (h - ch) / 2, box[1] = (w - cw) / 2, box[2] = ch, box[3] = cw;
}

static int flip_of(const params_t *p, uint64_t key) {
  return p->train && p->flip && uniform(key, FLIP_DRAW) < 0.5;
}

/* Largest DCT scale denominator (1, 2, 4, 8) that keeps the window's shorter side >= size;
 * 1 for resize_then_crop, which decodes at full resolution as TF does. */
static int dct_denom(const params_t *p, const long box[4]) {
  long shorter = box[2] < box[3] ? box[2] : box[3];
  if (!p->dct_scaling || (!p->train && p->resize_first)) return 1;
  for (int d = 8; d > 1; d /= 2)
    if (shorter >= (long)d * p->size) return d;
  return 1;
}

/* ------------------------------------------------------------------ tf.train.Example */

typedef struct {
  const uint8_t *p, *end;
} span_t;

/* protobuf's wire format, as much of it as a tf.train.Example uses. The parser gives
 * protobuf's answer or declines (-1) and the Python path (protobuf itself) decides: it checks
 * the whole record as protobuf does (so a record protobuf refuses is declined), and reads a
 * feature with protobuf's merge rules (see feature_value). Groups, tags and lengths of more
 * than 5 bytes (protobuf refuses them) and varints whose tenth byte protobuf might read
 * otherwise are declined, never guessed. */
static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t r = 0;
  for (int shift = 0; shift < 70 && *p < end; shift += 7) {
    uint8_t b = *(*p)++;
    if (shift == 63 && b > 1) return -1; /* bits past 64 */
    r |= (uint64_t)(b & 0x7F) << shift;
    if (!(b & 0x80)) {
      *v = r;
      return 0;
    }
  }
  return -1;
}

/* Next field of a message: its number, wire type, and (length-delimited) payload or varint. */
static int next_field(span_t *m, uint32_t *field, int *wire, span_t *payload, uint64_t *value) {
  uint64_t tag, len;
  const uint8_t *start = m->p;
  if (varint(&m->p, m->end, &tag) || m->p - start > 5 || tag > 0xFFFFFFFFu || (tag >> 3) == 0)
    return -1;
  *field = (uint32_t)(tag >> 3), *wire = (int)(tag & 7);
  switch (*wire) {
    case 0: return varint(&m->p, m->end, value);
    case 1: if (m->end - m->p < 8) return -1; m->p += 8; return 0;
    case 5: if (m->end - m->p < 4) return -1; m->p += 4; return 0;
    case 2:
      start = m->p;
      if (varint(&m->p, m->end, &len) || m->p - start > 5 || len > (uint64_t)(m->end - m->p) ||
          len > 0x7FFFFFFF)
        return -1;
      payload->p = m->p, payload->end = m->p + len;
      m->p += len;
      return 0;
    default: return -1; /* groups (3, 4) and invalid wire types */
  }
}

static int valid_utf8(span_t s) { /* proto3 strings (the feature keys) must be UTF-8 */
  const uint8_t *p = s.p;
  while (p < s.end) {
    uint8_t c = *p++;
    int more;
    uint32_t cp;
    if (c < 0x80) continue;
    if (c >= 0xC2 && c <= 0xDF) more = 1, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) more = 2, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) more = 3, cp = c & 0x07;
    else return 0;
    if (s.end - p < more) return 0;
    for (int k = 0; k < more; k++, p++) {
      if ((*p & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (*p & 0x3F);
    }
    if ((more == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (more == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
      return 0;
  }
  return 1;
}

/* Checks a BytesList (kind 1), FloatList (2) or Int64List (3) as protobuf parses it. */
static int check_list(span_t list, uint32_t kind) {
  span_t s;
  uint32_t f;
  int wire;
  uint64_t v;
  while (list.p < list.end) {
    if (next_field(&list, &f, &wire, &s, &v)) return -1;
    if (f != 1 || wire != 2 || kind == 1) continue;
    if (kind == 2 && (s.end - s.p) % 4) return -1; /* packed floats */
    while (kind == 3 && s.p < s.end)
      if (varint(&s.p, s.end, &v)) return -1; /* packed int64s */
  }
  return 0;
}

/* Checks a Feature: oneof bytes_list = 1, float_list = 2, int64_list = 3. */
static int check_feature(span_t feature) {
  span_t s;
  uint32_t f;
  int wire;
  uint64_t v;
  while (feature.p < feature.end) {
    if (next_field(&feature, &f, &wire, &s, &v)) return -1;
    if (wire == 2 && f >= 1 && f <= 3 && check_list(s, f)) return -1;
  }
  return 0;
}

/* Checks a map entry (key = 1, value = 2) and returns its key: the last one, as protobuf.
 * Declines entries with unknown fields: protobuf (upb) keeps them as unknown, not in the map. */
static int check_entry(span_t entry, span_t *key) {
  span_t s;
  uint32_t f;
  int wire;
  uint64_t v;
  key->p = key->end = entry.p; /* absent: "" */
  while (entry.p < entry.end) {
    if (next_field(&entry, &f, &wire, &s, &v)) return -1;
    if (wire != 2 || f > 2) return -1; /* upb moves such an entry out of the map: decline */
    if (f == 1 && !valid_utf8(s)) return -1; /* every occurrence, even one replaced later */
    if (f == 1) *key = s;
    if (f == 2 && check_feature(s)) return -1;
  }
  return 0;
}

/* What protobuf makes of the `value` fields of a map entry: they merge, so the oneof holds the
 * case of the last list seen, and its list is every same-case list since the case last changed
 * (repeated fields concatenate). Sets the first element of that list; `kind` 0 if none. */
typedef struct {
  uint32_t kind;
  int have;
  span_t bytes;
  int64_t int64;
} feature_t;

static void feature_value(span_t entry, feature_t *out) {
  span_t value, list, item;
  uint32_t f;
  int wire;
  uint64_t v;
  out->kind = 0, out->have = 0;
  while (entry.p < entry.end) { /* checked already: no errors below */
    if (next_field(&entry, &f, &wire, &value, &v) || f != 2 || wire != 2) continue;
    while (value.p < value.end) {
      if (next_field(&value, &f, &wire, &list, &v) || wire != 2 || f < 1 || f > 3) continue;
      if (f != out->kind) out->kind = f, out->have = 0; /* the oneof switches: a new list */
      while (!out->have && list.p < list.end) {
        if (next_field(&list, &f, &wire, &item, &v) || f != 1) continue;
        if (out->kind == 1 && wire == 2) {
          out->bytes = item, out->have = 1;
        } else if (out->kind == 3 && wire == 0) {
          out->int64 = (int64_t)v, out->have = 1;
        } else if (out->kind == 3 && wire == 2 && item.p < item.end) {
          varint(&item.p, item.end, &v);
          out->int64 = (int64_t)v, out->have = 1;
        }
      }
    }
  }
}

/* The image bytes and label of an Example: the first element of the image's bytes_list and of
 * the label's int64_list, as `pipeline.catalog.records.parse` reads them through protobuf (the last
 * map entry of a key wins, repeated `features` merge). Returns 0, or -1 to decline: not a
 * valid Example, a feature missing or of another kind, or wire format it does not handle. */
static int parse_example(const uint8_t *rec, size_t len, const char *image_key, size_t image_key_len,
                         const char *label_key, size_t label_key_len, span_t *image, int64_t *label) {
  span_t ex = {rec, rec + len}, features, entry, key, image_entry = {NULL, NULL},
         label_entry = {NULL, NULL};
  uint32_t f;
  int wire;
  uint64_t v;
  feature_t feat;
  while (ex.p < ex.end) {
    if (next_field(&ex, &f, &wire, &features, &v)) return -1;
    if (f != 1 || wire != 2) continue;
    while (features.p < features.end) {
      if (next_field(&features, &f, &wire, &entry, &v)) return -1;
      if (f != 1 || wire != 2) continue;
      if (check_entry(entry, &key)) return -1;
      size_t klen = (size_t)(key.end - key.p);
      if (klen == image_key_len && !memcmp(key.p, image_key, klen)) image_entry = entry;
      if (klen == label_key_len && !memcmp(key.p, label_key, klen)) label_entry = entry;
    }
  }
  if (image_entry.p == NULL || label_entry.p == NULL) return -1;
  feature_value(image_entry, &feat);
  if (feat.kind != 1 || !feat.have) return -1;
  *image = feat.bytes;
  feature_value(label_entry, &feat);
  if (feat.kind != 3 || !feat.have) return -1;
  *label = feat.int64;
  return 0;
}

/* ------------------------------------------------------------------ JPEG */

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  int in_header; /* reading the markers before the image data (jpeg_read_header) */
} error_mgr;

static void on_error(j_common_ptr cinfo) {
  error_mgr *err = (error_mgr *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

#define EXTRANEOUS "Corrupt JPEG data: %u extraneous bytes before marker 0x%02x"

/* Counts warnings and keeps the first one's text (the last message libjpeg formatted may be a
 * trace line). Bytes skipped between header segments are not counted: libjpeg reads the same
 * header as without them (identified by the message's text: its number varies by version). */
static void on_message(j_common_ptr cinfo, int level) {
  error_mgr *err = (error_mgr *)cinfo->err;
  int code = cinfo->err->msg_code;
  if (level >= 0) return;
  if (err->in_header && code > 0 && code <= cinfo->err->last_jpeg_message &&
      strcmp(cinfo->err->jpeg_message_table[code], EXTRANEOUS) == 0)
    return;
  if (cinfo->err->num_warnings++ == 0) (*cinfo->err->format_message)(cinfo, err->message);
}

#define NO_EOI "no end-of-image marker (FF D9) after the image data: the JPEG is truncated"

/* Whether an end-of-image marker follows `from` (where the image data starts): looked for from
 * the end, where it is, past any bytes appended after it. */
static int has_eoi(const uint8_t *from, const uint8_t *end) {
  for (const uint8_t *p = end - 1; p > from; p--)
    if (p[0] == 0xD9 && p[-1] == 0xFF) return 1;
  return 0;
}

/* The frame header libjpeg will decode, read without libjpeg: its SOF marker, sample precision,
 * height and width; 0 on success. Markers are found as libjpeg's next_marker finds them: bytes
 * other than FF before a marker are skipped (libjpeg warns), so are fill FFs and stuffed
 * `FF 00` pairs (a frame can hide behind those), so the frame found is the one libjpeg reads.
 * decode_window checks libjpeg's own size again. pipeline.image.decode.jpeg_frame walks the same. */
static int jpeg_frame(const uint8_t *b, size_t n, int *marker, int *precision, long *h, long *w) {
  size_t i = 2;
  *h = *w = -1, *marker = *precision = 0;
  if (n < 4 || b[0] != 0xFF || b[1] != 0xD8) return -1;
  for (;;) {
    while (i < n && b[i] != 0xFF) i++; /* bytes between segments */
    while (i < n && b[i] == 0xFF) i++; /* the marker's FF and fill bytes */
    if (i >= n) return -1;
    uint8_t m = b[i++]; /* b[i - 2] is the marker's FF */
    if (m == 0x00 || (m >= 0xD0 && m <= 0xD7) || m == 0x01) continue; /* stuffed; no length */
    if (m == 0xD8 || m == 0xD9 || m == 0xDA || i + 1 >= n) return -1; /* no frame before these */
    size_t len = ((size_t)b[i] << 8) | b[i + 1];
    if (len < 2) return -1;
    if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
      if (len < 8 || i + 6 >= n) return -1;
      *marker = m, *precision = b[i + 2];
      *h = ((long)b[i + 3] << 8) | b[i + 4];
      *w = ((long)b[i + 5] << 8) | b[i + 6];
      return *h > 0 && *w > 0 ? 0 : -1;
    }
    i += len;
  }
}

/* Baseline, extended sequential or progressive Huffman-coded 8-bit frames: what the fast paths
 * take. Lossless, 12/16-bit, arithmetic-coded and hierarchical ones go to the Python path
 * (Pillow), where scaled decoding cannot corrupt memory. */
static int plain_frame(int marker, int precision) {
  return (marker == 0xC0 || marker == 0xC1 || marker == 0xC2) && precision == 8;
}

static int too_many_pixels(unsigned long h, unsigned long w) {
  return (unsigned long long)h * w > MAX_PIXELS;
}

/* A buffer reused across images: growable, or `fixed` (a caller's slot) and never grown. */
typedef struct {
  uint8_t *p;
  size_t n;
  int fixed;
} scratch_t;

static uint8_t *reserve(scratch_t *s, size_t n) {
  if (n > s->n) {
    if (s->fixed) return NULL;
    uint8_t *p = realloc(s->p, n);
    if (p == NULL) return NULL;
    s->p = p, s->n = n;
  }
  return s->p;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <tmmintrin.h>
/* mirror_row's first pixels, 5 per SSSE3 shuffle; returns how many it wrote. Each load starts a
 * byte before its 5 source pixels and each store writes a byte past its 5, so neither leaves
 * the row: the loop stops with at least one pixel left to the caller. */
__attribute__((target("ssse3"))) static long mirror_ssse3(uint8_t *to, const uint8_t *from,
                                                           long w) {
  const __m128i reverse5 = _mm_setr_epi8(13, 14, 15, 10, 11, 12, 7, 8, 9, 4, 5, 6, 1, 2, 3, -128);
  long i = 0;
  for (; i + 6 <= w; i += 5) {
    __m128i v = _mm_loadu_si128((const __m128i *)(from + 3 * (w - 5 - i) - 1));
    _mm_storeu_si128((__m128i *)(to + 3 * i), _mm_shuffle_epi8(v, reverse5));
  }
  return i;
}
#endif

/* to = `from`'s w RGB pixels in reverse order (the buffers must not overlap). */
static void mirror_row(uint8_t *to, const uint8_t *from, long w) {
  long i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("ssse3")) i = mirror_ssse3(to, from, w);
#endif
  for (; i < w; i++) memcpy(to + 3 * i, from + 3 * (w - 1 - i), 3);
}

/* Whether resize_linear gives OpenCV's pixels for an h x w window at size x size: bilinear,
 * not area averaging (augment.interpolation: a shorter side over 2 x size), and not the exact
 * 2:1 shrink cv2.resize turns into area averaging itself. */
static int linear_resizable(long h, long w, long size) {
  return (h < w ? h : w) <= 2 * size && !(h == 2 * size && w == 2 * size);
}

/* OpenCV's (imgproc/resize.cpp) coefficient of output position d for a src -> dst resize:
 * the source index, the fraction in float, as cv2.resize computes them. */
static float resize_at(long d, long src, long dst, long *s) {
  double scale = 1. / ((double)dst / (double)src);
  float f = (float)((d + 0.5) * scale - 0.5);
  long i = (long)f;
  i -= (float)i > f; /* cvFloor */
  *s = i;
  return f - (float)i;
}

/* The horizontal pass's taps of output column dx: the source pixels at byte offsets lo[dx] and
 * hi[dx] (hi = lo + 3, or lo at a clamped edge) and their coefficients, packed as
 * coef[dx] = c_lo | c_hi << 16. */
typedef struct {
  int32_t *lo, *hi, *coef, *rows[2];
} taps_t;

static int16_t coef_lo(int32_t coef) { return (int16_t)(coef & 0xffff); }
static int16_t coef_hi(int32_t coef) { return (int16_t)((uint32_t)coef >> 16); }

/* Output column dx of the horizontal pass: h[3 dx + c] = c_lo * row[lo + c] + c_hi * row[hi + c]. */
static inline void resize_tap(int32_t *restrict h, const uint8_t *restrict row, const taps_t *t,
                              long dx) {
  const uint8_t *p = row + t->lo[dx], *q = row + t->hi[dx];
  int32_t c0 = coef_lo(t->coef[dx]), c1 = coef_hi(t->coef[dx]);
  h[3 * dx] = p[0] * c0 + q[0] * c1;
  h[3 * dx + 1] = p[1] * c0 + q[1] * c1;
  h[3 * dx + 2] = p[2] * c0 + q[2] * c1;
}

static void resize_row(int32_t *restrict h, const uint8_t *restrict row, const taps_t *t,
                       long size) {
  for (long dx = 0; dx < size; dx++) resize_tap(h, row, t, dx);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* resize_row with SSSE3: per column one 8-byte load of both taps, a shuffle into (lo, hi) pairs
 * of 16-bit channels and one multiply-add (the same integers: pixels and coefficients fit in
 * 16 bits, their sums in 32). A column whose load would pass the row's end is done as
 * resize_row does it; `h` has room for one int32 past 3 x size. */
__attribute__((target("ssse3"))) static void resize_row_ssse3(int32_t *restrict h,
                                                              const uint8_t *restrict row,
                                                              const taps_t *t, long w, long size) {
  const __m128i pairs = _mm_setr_epi8(0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128,
                                      -128, -128, -128);
  for (long dx = 0; dx < size; dx++) {
    if (t->lo[dx] + 8 > 3 * w) {
      resize_tap(h, row, t, dx);
      continue;
    }
    __m128i v = _mm_loadl_epi64((const __m128i *)(row + t->lo[dx]));
    __m128i m = _mm_madd_epi16(_mm_shuffle_epi8(v, pairs), _mm_set1_epi32(t->coef[dx]));
    _mm_storeu_si128((__m128i *)(h + 3 * dx), m);
  }
}
#endif

/* One output row from two horizontal rows: OpenCV's ((b0 * (s0 >> 4)) >> 16 + (b1 * (s1 >> 4))
 * >> 16 + 2) >> 2, 8 values at a time as its SSE2 code (16-bit multiplies keeping the high
 * half), the rest one at a time. */
static void resize_column(uint8_t *restrict out, const int32_t *s0, const int32_t *s1, int16_t b0,
                          int16_t b1, long n) {
  long x = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  const __m128i v0 = _mm_set1_epi16(b0), v1 = _mm_set1_epi16(b1), two = _mm_set1_epi16(2);
  for (; x + 8 <= n; x += 8) {
    __m128i a = _mm_packs_epi32(_mm_srai_epi32(_mm_loadu_si128((const __m128i *)(s0 + x)), 4),
                                _mm_srai_epi32(_mm_loadu_si128((const __m128i *)(s0 + x + 4)), 4));
    __m128i b = _mm_packs_epi32(_mm_srai_epi32(_mm_loadu_si128((const __m128i *)(s1 + x)), 4),
                                _mm_srai_epi32(_mm_loadu_si128((const __m128i *)(s1 + x + 4)), 4));
    __m128i r = _mm_add_epi16(_mm_mulhi_epi16(a, v0), _mm_mulhi_epi16(b, v1));
    r = _mm_srai_epi16(_mm_add_epi16(r, two), 2);
    _mm_storel_epi64((__m128i *)(out + x), _mm_packus_epi16(r, r));
  }
#endif
  for (; x < n; x++) {
    int32_t v = (((b0 * (s0[x] >> 4)) >> 16) + ((b1 * (s1[x] >> 4)) >> 16) + 2) >> 2;
    out[x] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
  }
}

/* cv2.resize(window, (size, size), interpolation=INTER_LINEAR) of an RGB h x w window into
 * `dst`, to the bit: OpenCV's 11-bit fixed-point coefficients (x clamped at the edges, y not:
 * its rows clamped instead), its horizontal pass in int32 and its vertical rounding
 * (resize_column). With `flip` the window's columns are read right to left: the resize of the
 * mirrored window, without mirroring it. `work`: room for resize_work(size) bytes. */
static size_t resize_work(long size) { return (size_t)(3 * size + 2 * (3 * size + 4)) * 4; }

static void resize_linear(const uint8_t *src, long h, long w, uint8_t *dst, long size, int flip,
                          void *work) {
  taps_t t;
  t.lo = (int32_t *)work, t.hi = t.lo + size, t.coef = t.hi + size;
  t.rows[0] = t.coef + size, t.rows[1] = t.rows[0] + 3 * size + 4;
  for (long dx = 0; dx < size; dx++) {
    long sx;
    float fx = resize_at(dx, w, size, &sx);
    if (sx < 0) fx = 0, sx = 0;
    if (sx >= w - 1) fx = 0, sx = w - 1;
    long sx1 = sx + 1 < w ? sx + 1 : w - 1;
    int32_t a0 = (int16_t)lrintf((1.f - fx) * 2048.f), a1 = (int16_t)lrintf(fx * 2048.f);
    if (flip) sx = w - 1 - sx, sx1 = w - 1 - sx1;
    int swap = sx1 < sx; /* mirrored: the second tap is the lower address */
    t.lo[dx] = (int32_t)(3 * (swap ? sx1 : sx)), t.hi[dx] = (int32_t)(3 * (swap ? sx : sx1));
    t.coef[dx] = (int32_t)((uint32_t)(uint16_t)(swap ? a1 : a0) |
                           (uint32_t)(uint16_t)(swap ? a0 : a1) << 16);
  }
  int ssse3 = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  ssse3 = __builtin_cpu_supports("ssse3");
#endif
  long have[2] = {-1, -1};
  for (long dy = 0; dy < size; dy++) {
    long sy;
    float fy = resize_at(dy, h, size, &sy);
    int16_t b0 = (int16_t)lrintf((1.f - fy) * 2048.f), b1 = (int16_t)lrintf(fy * 2048.f);
    long r[2] = {sy < 0 ? 0 : sy >= h ? h - 1 : sy, sy + 1 < 0 ? 0 : sy + 1 >= h ? h - 1 : sy + 1};
    int at[2];
    for (int k = 0; k < 2; k++) {
      at[k] = have[0] == r[k] ? 0 : have[1] == r[k] ? 1 : -1;
      if (at[k] < 0) { /* into the row this output row does not need */
        at[k] = k == 0 ? (have[1] == r[1] ? 0 : 1) : 1 - at[0];
        const uint8_t *row = src + (size_t)r[k] * w * 3;
#if defined(__x86_64__) && defined(__GNUC__)
        if (ssse3)
          resize_row_ssse3(t.rows[at[k]], row, &t, w, size);
        else
#endif
          resize_row(t.rows[at[k]], row, &t, size);
        have[at[k]] = r[k];
      }
    }
    resize_column(dst + (size_t)dy * size * 3, t.rows[at[0]], t.rows[at[1]], b0, b1, 3 * size);
  }
}

/* A window's pixels in reverse order, row by row, in place (for a window resized elsewhere). */
static void mirror_in_place(uint8_t *buf, long h, long w) {
  for (long r = 0; r < h; r++)
    for (uint8_t *a = buf + (size_t)r * w * 3, *b = a + (w - 1) * 3; a < b; a += 3, b -= 3)
      for (int c = 0; c < 3; c++) {
        uint8_t t = a[c];
        a[c] = b[c], b[c] = t;
      }
}

/* Decodes window (y, x, h, w) at 1/denom into `buf` (RGB, rows of `*out_w`), mirrored if
 * `flip`. 0 on success; else an error with `message`: -1 in the image data, -4 in the header
 * (libjpeg's jpeg_read_header refused it), -5 the window outside the frame libjpeg reads or that
 * frame too large; -2 when this path does not take it (CMYK/YCCK, lossless, 12-bit: the caller
 * converts with Pillow); -3 when `buf` cannot hold it. */
static int decode_window(const uint8_t *data, size_t len, long y, long x, long h, long w, int denom,
                         int fast_dct, int flip, scratch_t *buf, scratch_t *rows, int *out_h,
                         int *out_w, char *message) {
  struct jpeg_decompress_struct cinfo;
  error_mgr err;
  volatile int status = -1;

  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  err.in_header = 0;
  if (setjmp(err.jump)) {
    snprintf(message, MSG, "%s", err.message);
    jpeg_destroy_decompress(&cinfo);
    return status;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, (unsigned long)len);
  err.in_header = 1;
  status = -4;
  jpeg_read_header(&cinfo, TRUE);
  status = -1;
  err.in_header = 0;
  if (err.pub.num_warnings > 0) longjmp(err.jump, 1);
  if (!has_eoi(cinfo.src->next_input_byte, data + len)) {
    snprintf(err.message, sizeof(err.message), NO_EOI);
    longjmp(err.jump, 1);
  }
  /* The frame libjpeg is about to decode, before jpeg_start_decompress allocates for it. */
  if (too_many_pixels(cinfo.image_height, cinfo.image_width)) {
    status = -5;
    snprintf(err.message, sizeof(err.message), "%ux%u image exceeds the %llu-pixel limit",
             cinfo.image_width, cinfo.image_height, MAX_PIXELS);
    longjmp(err.jump, 1);
  }
  /* Lossless frames have a sequential first scan that is not 0..63 (its predictor). */
  if (cinfo.data_precision != 8 || (!cinfo.progressive_mode && (cinfo.Ss != 0 || cinfo.Se != 63))) {
    status = -2;
    if (cinfo.data_precision != 8)
      snprintf(err.message, sizeof(err.message), "%d-bit JPEG", cinfo.data_precision);
    else
      snprintf(err.message, sizeof(err.message), "lossless JPEG");
    longjmp(err.jump, 1);
  }
  if (y < 0 || x < 0 || h <= 0 || w <= 0 || y > (long)cinfo.image_height ||
      h > (long)cinfo.image_height - y || x > (long)cinfo.image_width ||
      w > (long)cinfo.image_width - x) {
    status = -5;
    snprintf(err.message, sizeof(err.message), "crop (y=%ld, x=%ld, h=%ld, w=%ld) outside %ux%u",
             y, x, h, w, cinfo.image_height, cinfo.image_width);
    longjmp(err.jump, 1);
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    status = -2;
    snprintf(err.message, sizeof(err.message), "CMYK/YCCK JPEG");
    longjmp(err.jump, 1);
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = denom;
  cinfo.dct_method = fast_dct ? JDCT_IFAST : JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  /* The window in scaled coordinates, clipped to the scaled image. */
  long sy = y / denom, sx = x / denom, oh = h / denom, ow = w / denom;
  if (oh < 1) oh = 1;
  if (ow < 1) ow = 1;
  if (sy >= (long)cinfo.output_height) sy = cinfo.output_height - 1;
  if (sx >= (long)cinfo.output_width) sx = cinfo.output_width - 1;
  if (sy + oh > (long)cinfo.output_height) oh = cinfo.output_height - sy;
  if (sx + ow > (long)cinfo.output_width) ow = cinfo.output_width - sx;
  /* jpeg_crop_scanline widens the columns to iMCU boundaries: xoff <= sx. */
  JDIMENSION xoff = (JDIMENSION)sx, cw = (JDIMENSION)ow;
  if (cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw);
  /* Decode whole row groups (cw wide), then drop the columns left of the window in place
   * (mirrored if `flip`). */
  size_t full = (size_t)cw * 3, n = (size_t)ow * 3, shift = (size_t)(sx - xoff) * 3;
  uint8_t *result = reserve(buf, (size_t)oh * full);
  /* the row pointers, then room for one mirrored row */
  JSAMPROW *rowp = (JSAMPROW *)reserve(rows, sizeof(JSAMPROW) * (size_t)oh + n);
  if (result == NULL || rowp == NULL) {
    status = -3;
    snprintf(err.message, sizeof(err.message), "out of memory, or the window exceeds its slot");
    longjmp(err.jump, 1);
  }
  for (long r = 0; r < oh; r++) rowp[r] = result + (size_t)r * full;
  if (sy > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)sy);
  for (long r = 0; r < oh;) r += jpeg_read_scanlines(&cinfo, rowp + r, (JDIMENSION)(oh - r));
  uint8_t *mirrored = (uint8_t *)(rowp + oh);
  for (long r = 0; r < oh; r++) {
    uint8_t *to = result + (size_t)r * n;
    if (flip) {  /* rows overlap their compacted place: mirror into the spare row, copy back */
      mirror_row(mirrored, rowp[r] + shift, ow);
      memcpy(to, mirrored, n);
    } else {
      memmove(to, rowp[r] + shift, n);
    }
  }
  if (err.pub.num_warnings > 0) longjmp(err.jump, 1); /* with the first warning's text */
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  *out_h = (int)oh, *out_w = (int)ow;
  return 0;
}

/* ------------------------------------------------------------------ the batch decoder */

/* The Python path's words for a broken JPEG (pipeline.image.decode: decode_crop, and image_size on
 * the ValueError of header() below), so a record is reported alike on either path. */
#define DECODE_FAILED "JPEG decode failed: "
#define NO_FRAME "no JPEG frame header with a valid size (%s)"
#define UNREADABLE_HEADER "unreadable image header (ValueError: " NO_FRAME ")"

enum { OK = 0, PYTHON_PATH = 1, BROKEN = 2 };

typedef struct {
  const uint8_t *data;
  size_t len;
  int64_t epoch, index;
  int status;
  char message[MSG + sizeof(UNREADABLE_HEADER)];
} item_t;

/* A decode stage's fixed settings: BatchDecoder(params, size, slot_bytes, seed, image_key,
 * label_key), params as augment.Head.native_params() gives them. */
typedef struct {
  PyObject_HEAD
  params_t p;
  Py_ssize_t slot_bytes;
  uint64_t seed;
  const char *ik, *lk; /* the feature keys, inside `args` */
  Py_ssize_t ikl, lkl;
  PyObject *args; /* the constructor's arguments: kept for the keys and for pickling */
} decoder_t;

/* One image, without the GIL: parse, header, window, decode (mirrored) into its arena slot; with
 * `out` (its batch slot) resized there instead where resize_linear can (dims then (0, 0)). */
static void load_one(item_t *it, const decoder_t *d, scratch_t *slot, int32_t *dims,
                     int32_t *full, int64_t *label, scratch_t *rows, uint8_t *out, void *work) {
  const params_t *p = &d->p;
  span_t image = {NULL, NULL};
  long h, w, box[4];
  int oh = 0, ow = 0, marker, precision;
  char message[MSG];
  if (parse_example(it->data, it->len, d->ik, (size_t)d->ikl, d->lk, (size_t)d->lkl, &image,
                    label) ||
      jpeg_frame(image.p, (size_t)(image.end - image.p), &marker, &precision, &h, &w) ||
      !plain_frame(marker, precision) || too_many_pixels((unsigned long)h, (unsigned long)w)) {
    it->status = PYTHON_PATH; /* the Python path names the problem, or takes the format */
    return;
  }
  uint64_t key = example_key(d->seed, (uint64_t)it->epoch, (uint64_t)it->index);
  crop_box(p, h, w, key, box);
  if (full != NULL) full[0] = (int32_t)h, full[1] = (int32_t)w;
  int flip = flip_of(p, key);
  int rc = decode_window(image.p, (size_t)(image.end - image.p), box[0], box[1], box[2], box[3],
                         dct_denom(p, box), p->fast_dct, flip && out == NULL, slot, rows, &oh, &ow,
                         message);
  if (rc == 0 && out != NULL) {
    if (linear_resizable(oh, ow, p->size)) { /* resized here, mirrored on the way: no window */
      resize_linear(slot->p, oh, ow, out, p->size, flip, work);
      oh = ow = 0;
    } else if (flip) {
      mirror_in_place(slot->p, oh, ow);
    }
  }
  if (rc == -1 || rc == -4) {
    it->status = BROKEN;
    snprintf(it->message, sizeof(it->message), rc == -1 ? DECODE_FAILED "%s" : UNREADABLE_HEADER,
             message);
  } else if (rc != 0) { /* -5: libjpeg reads another frame than jpeg_frame: Python decides */
    it->status = PYTHON_PATH;
  }
  dims[0] = oh, dims[1] = ow;
}

static int get_params(PyObject *t, params_t *p) {
  double area_lo, area_hi, ratio_lo, ratio_hi;
  if (!PyArg_ParseTuple(t, "pppp(dd)(dd)dppdp", &p->train, &p->flip, &p->dct_scaling,
                        &p->fast_dct, &area_lo, &area_hi, &ratio_lo, &ratio_hi, &p->crop_fraction,
                        &p->tf_crop, &p->resize_first, &p->min_covered, &p->flax_center))
    return -1;
  p->area_lo = area_lo, p->area_hi = area_hi, p->ratio_lo = ratio_lo, p->ratio_hi = ratio_hi;
  p->log_ratio_lo = log(ratio_lo), p->log_ratio_hi = log(ratio_hi);
  return 0;
}

static int writable(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t n, const char *what) {
  if (itemsize <= 0 || n < 0 || n > PY_SSIZE_T_MAX / itemsize) {
    PyErr_Format(PyExc_ValueError, "%s: %zd items of %zd bytes is not a size", what, n, itemsize);
    return -1;
  }
  if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) return -1;
  if (b->len < itemsize * n) {
    PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, b->len, itemsize * n);
    PyBuffer_Release(b);
    return -1;
  }
  return 0;
}

static PyObject *decoder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"params", "size", "slot_bytes", "seed", "image_key", "label_key", NULL};
  PyObject *params, *ik, *lk;
  int size;
  Py_ssize_t slot_bytes;
  unsigned long long seed;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OinKSS", names, &params, &size, &slot_bytes,
                                   &seed, &ik, &lk))
    return NULL;
  if (size < 1 || slot_bytes < 3) {
    PyErr_Format(PyExc_ValueError, "size %d or slot_bytes %zd too small", size, slot_bytes);
    return NULL;
  }
  decoder_t *d = (decoder_t *)type->tp_alloc(type, 0);
  if (d == NULL) return NULL;
  d->args = Py_BuildValue("(OinKOO)", params, size, slot_bytes, seed, ik, lk);
  if (d->args == NULL || get_params(params, &d->p)) {
    Py_DECREF(d);
    return NULL;
  }
  d->p.size = size, d->slot_bytes = slot_bytes, d->seed = seed;
  d->ik = PyBytes_AS_STRING(ik), d->ikl = PyBytes_GET_SIZE(ik);
  d->lk = PyBytes_AS_STRING(lk), d->lkl = PyBytes_GET_SIZE(lk);
  return (PyObject *)d;
}

static void decoder_dealloc(PyObject *self) {
  Py_XDECREF(((decoder_t *)self)->args);
  Py_TYPE(self)->tp_free(self);
}

static PyObject *decoder_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_BuildValue("(OO)", Py_TYPE(self), ((decoder_t *)self)->args);
}

/* decoder(records, epochs, indices, labels, dims, arena, start, stop, sizes=None, images=None,
 *         rows=None):
 * records [start, stop) of a batch (None: no record); record i's mirrored crop window goes to
 * arena[(i - start) * slot_bytes:] as dims[i] = (rows, cols) RGB pixels ((0, 0): no window), its
 * label to labels[i], its full-resolution (height, width) to sizes[i] when given (int32[n, 2]).
 * With `images` (uint8[n, size, size, 3]), a window cv2.resize would resize bilinearly is
 * resized into images[i] here instead, with OpenCV's pixels (resize_linear; dims[i] (0, 0)); with
 * `rows` (int64[n], a mixture's rows) into images[rows[i]].
 * Returns [(i, message)] of the records it hands back: message None for the Python path, else
 * why the record is broken. */
static PyObject *decoder_call(PyObject *self, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"records", "epochs", "indices", "labels", "dims", "arena", "start",
                          "stop", "sizes", "images", "rows", NULL};
  const decoder_t *d = (const decoder_t *)self;
  PyObject *recs, *epochs_o, *indices_o, *labels_o, *dims_o, *arena_o, *sizes_o = Py_None;
  PyObject *images_o = Py_None, *rows_o = Py_None;
  Py_buffer labels, dims, arena, epochs, indices, sizes = {0}, images = {0}, rows_b = {0};
  long size = d->p.size;
  Py_ssize_t start, stop, slot_bytes = d->slot_bytes;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOOOnn|OOO", names, &PyList_Type, &recs,
                                   &epochs_o, &indices_o, &labels_o, &dims_o, &arena_o, &start,
                                   &stop, &sizes_o, &images_o, &rows_o))
    return NULL;
  Py_ssize_t n = PyList_GET_SIZE(recs);
  if (start < 0 || stop > n || start > stop) {
    PyErr_Format(PyExc_ValueError, "chunk [%zd, %zd) outside the %zd records", start, stop, n);
    return NULL;
  }
  if (writable(labels_o, &labels, 8, n, "labels")) return NULL;
  if (writable(dims_o, &dims, 8, n, "dims")) goto release_labels;
  if (writable(arena_o, &arena, slot_bytes, stop - start, "arena")) goto release_dims;
  if (PyObject_GetBuffer(epochs_o, &epochs, PyBUF_C_CONTIGUOUS)) goto release_arena;
  if (PyObject_GetBuffer(indices_o, &indices, PyBUF_C_CONTIGUOUS)) goto release_epochs;
  int have_sizes = sizes_o != Py_None;
  if (have_sizes && writable(sizes_o, &sizes, 8, n, "sizes")) goto release_indices;
  int have_images = images_o != Py_None, have_rows = have_images && rows_o != Py_None;
  Py_ssize_t image_bytes = size * size * 3;
  if (have_images && writable(images_o, &images, image_bytes, have_rows ? 1 : n, "images"))
    goto release_sizes;
  if (have_rows && PyObject_GetBuffer(rows_o, &rows_b, PyBUF_C_CONTIGUOUS)) {
    PyBuffer_Release(&images);
    goto release_sizes;
  }
  item_t *items = NULL;
  void *work = NULL;
  if (epochs.len != 8 * n || indices.len != 8 * n || (have_rows && rows_b.len != 8 * n)) {
    PyErr_SetString(PyExc_ValueError, "epochs, indices and rows must be int64[n]");
    goto release_all;
  }
  for (Py_ssize_t i = start; have_rows && i < stop; i++) {
    int64_t row = ((int64_t *)rows_b.buf)[i];
    if (row < 0 || row >= images.len / image_bytes) {
      PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld outside the %zd images", i,
                   (long long)row, images.len / image_bytes);
      goto release_all;
    }
  }
  items = calloc((size_t)(stop - start) + 1, sizeof(item_t));
  if (have_images) work = malloc(resize_work(size));
  if (items == NULL || (have_images && work == NULL)) {
    PyErr_NoMemory();
    goto release_all;
  }
  for (Py_ssize_t i = start; i < stop; i++) {
    PyObject *r = PyList_GET_ITEM(recs, i);
    item_t *it = &items[i - start];
    it->epoch = ((int64_t *)epochs.buf)[i], it->index = ((int64_t *)indices.buf)[i];
    if (r == Py_None) continue; /* padding, or a record that failed to read */
    if (!PyBytes_Check(r)) {
      PyErr_Format(PyExc_TypeError, "record %zd is %s, not bytes", i, Py_TYPE(r)->tp_name);
      goto release_all;
    }
    it->data = (const uint8_t *)PyBytes_AS_STRING(r), it->len = (size_t)PyBytes_GET_SIZE(r);
  }
  Py_BEGIN_ALLOW_THREADS
  scratch_t rows = {0};
  for (Py_ssize_t i = start; i < stop; i++) {
    item_t *it = &items[i - start];
    scratch_t slot = {(uint8_t *)arena.buf + (i - start) * slot_bytes, (size_t)slot_bytes, 1};
    int32_t *window = (int32_t *)dims.buf + 2 * i;
    window[0] = window[1] = 0; /* no window, unless decoded below */
    if (it->data != NULL)
      load_one(it, d, &slot, window, have_sizes ? (int32_t *)sizes.buf + 2 * i : NULL,
               (int64_t *)labels.buf + i, &rows,
               have_images ? (uint8_t *)images.buf +
                                 (have_rows ? ((int64_t *)rows_b.buf)[i] : i) * image_bytes
                           : NULL,
               work);
  }
  free(rows.p);
  Py_END_ALLOW_THREADS
  PyObject *handed_back = PyList_New(0);
  for (Py_ssize_t i = start; handed_back != NULL && i < stop; i++) {
    item_t *it = &items[i - start];
    if (it->status == OK) continue;
    PyObject *t = it->status == BROKEN ? Py_BuildValue("(ns)", i, it->message)
                                       : Py_BuildValue("(nO)", i, Py_None);
    if (t == NULL || PyList_Append(handed_back, t)) Py_CLEAR(handed_back);
    Py_XDECREF(t);
  }
  free(items), free(work);
  if (have_rows) PyBuffer_Release(&rows_b);
  if (have_images) PyBuffer_Release(&images);
  if (have_sizes) PyBuffer_Release(&sizes);
  PyBuffer_Release(&indices), PyBuffer_Release(&epochs), PyBuffer_Release(&arena);
  PyBuffer_Release(&dims), PyBuffer_Release(&labels);
  return handed_back;
release_all:
  free(items), free(work);
  if (have_rows) PyBuffer_Release(&rows_b);
  if (have_images) PyBuffer_Release(&images);
release_sizes:
  if (have_sizes) PyBuffer_Release(&sizes);
release_indices:
  PyBuffer_Release(&indices);
release_epochs:
  PyBuffer_Release(&epochs);
release_arena:
  PyBuffer_Release(&arena);
release_dims:
  PyBuffer_Release(&dims);
release_labels:
  PyBuffer_Release(&labels);
  return NULL;
}

static PyMethodDef decoder_methods[] = {
    {"__reduce__", decoder_reduce, METH_NOARGS, "Pickles as its constructor's arguments."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject decoder_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pipeline.image._jpeg.BatchDecoder",
    .tp_basicsize = sizeof(decoder_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BatchDecoder(params, size, slot_bytes, seed, image_key, label_key): a decode "
              "stage's fixed settings; decoder(records, epochs, indices, labels, dims, arena, "
              "start, stop, sizes=None) -> [(i, message)] handed back (None: the Python path)",
    .tp_new = decoder_new,
    .tp_dealloc = decoder_dealloc,
    .tp_call = decoder_call,
    .tp_methods = decoder_methods,
};

static PyObject *decode_crop(PyObject *Py_UNUSED(self), PyObject *args) {
  Py_buffer data;
  long y, x, h, w;
  int denom, fast_dct = 0, oh = 0, ow = 0, status;
  char message[MSG] = {0};
  scratch_t buf = {0}, rows = {0};
  if (!PyArg_ParseTuple(args, "y*lllli|p", &data, &y, &x, &h, &w, &denom, &fast_dct)) return NULL;
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_ValueError, "scale_denom must be 1, 2, 4 or 8");
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  status = decode_window(data.buf, (size_t)data.len, y, x, h, w, denom, fast_dct, 0, &buf, &rows,
                         &oh, &ow, message);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&data);
  free(rows.p);
  if (status != 0) {
    free(buf.p);
    PyErr_Format(PyExc_ValueError, DECODE_FAILED "%s%s", message,
                 status == -2 ? " (not for this decoder: color conversion or mode)" : "");
    return NULL;
  }
  PyObject *out = PyBytes_FromStringAndSize((const char *)buf.p, (Py_ssize_t)oh * ow * 3);
  free(buf.p);
  if (out == NULL) return NULL;
  return Py_BuildValue("(Nii)", out, oh, ow);
}

/* header(data) -> (height, width) of the frame libjpeg decodes (its own jpeg_read_header). */
static PyObject *header(PyObject *Py_UNUSED(self), PyObject *args) {
  Py_buffer data;
  struct jpeg_decompress_struct cinfo;
  error_mgr err;
  volatile long h = -1, w = -1;
  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  err.message[0] = 0;
  err.in_header = 1;
  if (setjmp(err.jump) == 0) {
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    h = (long)cinfo.image_height, w = (long)cinfo.image_width;
  }
  jpeg_destroy_decompress(&cinfo);
  PyBuffer_Release(&data);
  if (h < 1 || w < 1) {
    PyErr_Format(PyExc_ValueError, NO_FRAME, err.message);
    return NULL;
  }
  return Py_BuildValue("(ll)", h, w);
}

/* frame(data) -> (SOF marker, precision, height, width): see jpeg_frame; None if none. */
static PyObject *frame(PyObject *Py_UNUSED(self), PyObject *args) {
  Py_buffer data;
  long h, w;
  int marker, precision;
  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  int rc = jpeg_frame(data.buf, (size_t)data.len, &marker, &precision, &h, &w);
  PyBuffer_Release(&data);
  if (rc) Py_RETURN_NONE;
  return Py_BuildValue("(iill)", marker, precision, h, w);
}

/* parse_example(record, image_key, label_key) -> (image offset, image length, label), or None
 * where the batch path declines the record: the native parser alone, for the differential
 * tests against protobuf. */
static PyObject *parse_example_py(PyObject *Py_UNUSED(self), PyObject *args) {
  Py_buffer rec;
  const char *ik, *lk;
  Py_ssize_t ikl, lkl;
  span_t image;
  int64_t label;
  if (!PyArg_ParseTuple(args, "y*y#y#", &rec, &ik, &ikl, &lk, &lkl)) return NULL;
  int rc = parse_example(rec.buf, (size_t)rec.len, ik, (size_t)ikl, lk, (size_t)lkl, &image, &label);
  Py_ssize_t offset = rc ? 0 : (Py_ssize_t)(image.p - (const uint8_t *)rec.buf);
  PyBuffer_Release(&rec);
  if (rc) Py_RETURN_NONE;
  return Py_BuildValue("(nnL)", offset, (Py_ssize_t)(image.end - image.p), (long long)label);
}

/* ------------------------------------------------------------------ the geometry, for Python
 * The Python path draws its windows, flips and DCT scales with these, the batch path's own
 * functions; pipeline/image/fallback.py is their Python twin, used only where this was not built. */

static PyObject *example_key_py(PyObject *Py_UNUSED(self), PyObject *args) {
  unsigned long long seed, epoch, index;
  if (!PyArg_ParseTuple(args, "KKK", &seed, &epoch, &index)) return NULL;
  return PyLong_FromUnsignedLongLong(example_key(seed, epoch, index));
}

static PyObject *uniform_py(PyObject *Py_UNUSED(self), PyObject *args) {
  unsigned long long key, k;
  if (!PyArg_ParseTuple(args, "KK", &key, &k)) return NULL;
  return PyFloat_FromDouble(uniform(key, k));
}

/* The crop box of an h x w image under `p` (train, tf_crop, area, ratio, crop_fraction). */
static PyObject *box_of(params_t *p, long h, long w, uint64_t key) {
  long box[4];
  if (h < 1 || w < 1) {
    PyErr_Format(PyExc_ValueError, "image size %ldx%ld is not positive", h, w);
    return NULL;
  }
  p->log_ratio_lo = log(p->ratio_lo), p->log_ratio_hi = log(p->ratio_hi);
  crop_box(p, h, w, key, box);
  return Py_BuildValue("(llll)", box[0], box[1], box[2], box[3]);
}

static PyObject *random_resized_crop_box_py(PyObject *Py_UNUSED(self), PyObject *args) {
  params_t p = {.train = 1};
  long h, w;
  unsigned long long key;
  if (!PyArg_ParseTuple(args, "llK(dd)(dd)", &h, &w, &key, &p.area_lo, &p.area_hi, &p.ratio_lo,
                        &p.ratio_hi))
    return NULL;
  return box_of(&p, h, w, key);
}

static PyObject *tf_inception_crop_box_py(PyObject *Py_UNUSED(self), PyObject *args) {
  params_t p = {.train = 1, .tf_crop = 1};
  long h, w;
  unsigned long long key;
  if (!PyArg_ParseTuple(args, "llK(dd)(dd)|d", &h, &w, &key, &p.area_lo, &p.area_hi, &p.ratio_lo,
                        &p.ratio_hi, &p.min_covered))
    return NULL;
  return box_of(&p, h, w, key);
}

static PyObject *center_crop_box_py(PyObject *Py_UNUSED(self), PyObject *args) {
  params_t p = {.ratio_lo = 1, .ratio_hi = 1};
  long h, w;
  if (!PyArg_ParseTuple(args, "lld|p", &h, &w, &p.crop_fraction, &p.flax_center)) return NULL;
  return box_of(&p, h, w, 0);
}

static PyObject *dct_scale_py(PyObject *Py_UNUSED(self), PyObject *args) {
  params_t p = {.train = 1, .dct_scaling = 1};
  long box[4];
  if (!PyArg_ParseTuple(args, "(llll)i", &box[0], &box[1], &box[2], &box[3], &p.size)) return NULL;
  return PyLong_FromLong(dct_denom(&p, box));
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "header(data) -> (height, width) of the frame libjpeg decodes"},
    {"frame", frame, METH_VARARGS,
     "frame(data) -> (SOF marker, precision, height, width) of a JPEG's frame header, or None"},
    {"parse_example", parse_example_py, METH_VARARGS,
     "parse_example(record, image_key, label_key) -> (image offset, length, label) or None"},
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, y, x, h, w, scale_denom, fast_dct=False) -> (rgb bytes, height, width)"},
    {"example_key", example_key_py, METH_VARARGS,
     "example_key(seed, epoch, index) -> the key of an example's random draws"},
    {"uniform", uniform_py, METH_VARARGS, "uniform(key, k) -> draw k of an example, in [0, 1)"},
    {"random_resized_crop_box", random_resized_crop_box_py, METH_VARARGS,
     "random_resized_crop_box(h, w, key, area, ratio) -> (y, x, h, w): torchvision's crop"},
    {"tf_inception_crop_box", tf_inception_crop_box_py, METH_VARARGS,
     "tf_inception_crop_box(h, w, key, area, ratio, min_covered=0) -> (y, x, h, w): TF's crop"},
    {"center_crop_box", center_crop_box_py, METH_VARARGS,
     "center_crop_box(h, w, crop_fraction, flax=False) -> (y, x, h, w): the eval crop"},
    {"dct_scale", dct_scale_py, METH_VARARGS,
     "dct_scale(box, size) -> the DCT scale denominator (1, 2, 4, 8) of a window"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg",
                                    "Per-batch parse and crop-aware JPEG decode.", -1,
                                    methods, NULL, NULL, NULL, NULL};

/* The libjpeg API version this file was compiled against: pipeline/image/decode.py reads it
 * (without binding any libjpeg symbol) to load a library of the same ABI before import. */
__attribute__((visibility("default"))) int pipeline_jpeg_lib_version(void) {
  return JPEG_LIB_VERSION;
}

PyMODINIT_FUNC PyInit__jpeg(void) {
  if (PyType_Ready(&decoder_type)) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m != NULL && (PyModule_AddIntConstant(m, "MAX_PIXELS", (long)MAX_PIXELS) ||
                    PyModule_AddObjectRef(m, "BatchDecoder", (PyObject *)&decoder_type)))
    Py_CLEAR(m);
  return m;
}
